"""The trainer contract, the resume battery's counterpart of the recipe: what ``--trainer=pkg.module:factory`` must
build, and the one loader that builds it on every rank.

The factory is called with no argument on every rank, inside the initialized default process group, after the battery
has seeded Python's, numpy's and torch's global generators for the rank. It returns an object with:

* ``step() -> float``: one optimizer step (its data, forward, backward, update, schedule); returns the loss to log.
* ``save(folder)``: collective (every rank calls it); writes everything a resume needs into ``folder`` (it exists and
  is empty). No completion marker is needed: the battery commits the folder (a manifest of every file, written last)
  once every rank's ``save`` has returned, and resumes only from committed folders.
* ``load(folder)``: collective; restores everything from a committed folder, into a freshly built trainer.
* ``state() -> Mapping``: everything that must match after a resume, as tensors and plain values: weights, optimizer
  and scheduler state, the data position, every generator the trainer owns (``torch.Generator.get_state()``,
  ``random.Random.getstate()``), and ``"step"``: the optimizer steps taken, which is what its checkpoints are labelled
  with. The global generators are the battery's to compare; a trainer that keeps them in ``state()`` too is fine.
  The values admitted (:func:`check_state`): tensors, numpy arrays and scalars (``np.random.get_state()`` holds
  one), ``None``, bools, ints, floats, complex numbers, strings, bytes, torch dtypes and devices, nested in dicts (any
  mapping), lists and tuples. Each is compared bitwise; anything else is refused with its key named.

An optional ``close()`` is called before the process group goes away (drop a DDP module there).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol, cast, runtime_checkable

from harness.core.paths import resolve

HARNESS_TRAINER = "harness.training.trainer:trainer_factory"
"""The default ``--trainer``: the harness's own trainer on ``configs/minimum.yaml``."""

METHODS = ("step", "save", "load", "state")

_FIX = ("the trainer contract wants a zero-argument factory (or class) whose result has step(), save(folder), "
        "load(folder) and state() (see docs/resume.md)")


@runtime_checkable
class Trainer(Protocol):
    def step(self) -> float: ...

    def save(self, folder: Path) -> None: ...

    def load(self, folder: Path) -> None: ...

    def state(self) -> Mapping[str, Any]: ...


class TrainerError(ValueError):
    """A ``--trainer`` that cannot be used: a bad path, an import error, or an object without the contract's methods."""


def split_trainer_path(path: object) -> tuple[str, str]:
    """``"pkg.module:factory"`` -> ``("pkg.module", "factory")``; TrainerError naming the fix otherwise."""
    if not isinstance(path, str) or path.count(":") != 1 or not all(path.split(":")):
        msg = (f"--trainer={path!r} must look like 'package.module:factory' (for example "
               f"{HARNESS_TRAINER} or harness.resume.examples.plain:build)")
        raise TrainerError(msg)
    module, attr = path.split(":")
    return module, attr


def resolve_factory(path: str) -> Any:
    """The factory ``path`` names, imported but not called (safe in the parent process: nothing is built)."""
    _, attr = split_trainer_path(path)
    obj = resolve(path, "--trainer", _FIX, TrainerError)
    if not callable(obj):
        msg = f"--trainer={path!r}: {attr} is a {type(obj).__name__}, not a factory; {_FIX}"
        raise TrainerError(msg)
    return obj


_LEAVES = (type(None), bool, int, float, complex, str, bytes)


def _outside(value: Any, path: str) -> tuple[str, Any] | None:
    """``(path, value)`` of the first value in ``value`` the contract does not admit; None when all are admitted."""
    import numpy as np
    import torch

    if isinstance(value, (*_LEAVES, torch.Tensor, torch.dtype, torch.device, np.generic)):
        return None
    if isinstance(value, np.ndarray):
        return (path, value) if value.dtype.hasobject else None  # an object array's == is each element's own
    if isinstance(value, Mapping):
        for key, item in value.items():
            found = _outside(item, f"{path}[{key!r}]")
            if found is not None:
                return found
        return None
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            found = _outside(item, f"{path}[{i}]")
            if found is not None:
                return found
        return None
    return path, value


def check_state(state: object) -> Mapping[str, Any]:
    """``state`` once it is a mapping of values the contract admits (see the module's docstring); TrainerError
    naming the key, the type and the fix otherwise."""
    if not isinstance(state, Mapping):
        msg = (f"the trainer's state() returned a {type(state).__name__}, not a mapping of named entries (a dict); "
               f"{_STATE}")
        raise TrainerError(msg)
    found = _outside(state, "")
    if found is not None:
        path, value = found
        kind = f"{type(value).__module__}.{type(value).__qualname__}"
        if type(value).__module__ == "numpy":
            kind += " of objects"
        msg = (f"the trainer's state(){path} is a {kind}, which the resume battery cannot compare bitwise; {_STATE} "
               "(a generator's get_state() or getstate(), an object's state_dict(), or the numbers it holds)")
        raise TrainerError(msg)
    return cast(Mapping[str, Any], state)


_STATE = ("the contract admits tensors, numpy arrays and scalars, None, bools, ints, floats, complex numbers, strings, "
          "bytes, torch dtypes and devices, nested in dicts, lists and tuples; return such a value instead")


def load_trainer(path: str) -> Trainer:
    """Build the trainer ``path`` names (on a rank, inside the process group); TrainerError when the object it returns
    lacks one of the contract's methods."""
    trainer = resolve_factory(path)()
    missing = [m for m in METHODS if not callable(getattr(trainer, m, None))]
    if missing:
        msg = f"--trainer={path!r}: the {type(trainer).__name__} it built has no {', '.join(missing)}; {_FIX}"
        raise TrainerError(msg)
    return trainer


__all__ = ["HARNESS_TRAINER", "METHODS", "Trainer", "TrainerError", "check_state", "load_trainer", "resolve_factory",
           "split_trainer_path"]
