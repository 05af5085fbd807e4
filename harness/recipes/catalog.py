"""The negative controls' catalog: each control is one class that declares, where it is defined, where the battery
must reject it (:class:`Target`) and what the diagnosis must read in its gradient; :func:`control` registers it.

``harness.recipes.CONTROLS``, ``DIAGNOSES`` and ``SCENARIO_CONTROLS`` are derived from the registry, so adding a
control is one decorated class and its instance; ``tests/unit/test_control_catalog.py`` fails on a control class that
is not registered.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from harness.core.formats import HARNESS
from harness.core.mesh import Mesh

IN_PROCESS = "in-process"
TORCHRUN_NODES = "torchrun-nodes"
LAUNCHES = (IN_PROCESS, TORCHRUN_NODES)
"""How a control's ranks must be launched (:attr:`Target.launch`)."""


@dataclass(frozen=True)
class Target:
    """Where a negative control must be rejected: the check, the scenario and the precision that see its mistake,
    and how the mistake shows (``"numbers"``: the check's own comparison fails; ``"desync"``: ranks stop matching
    collectives, and the run is stopped with the rank that left); where the mistake shows only at some world sizes,
    those (``world_sizes``), and how the ranks must be launched for it to show at all (``launch``)."""

    check: str
    scenario: str
    precision: str = "fp32"
    shows_as: str = "numbers"
    batch_format: str = HARNESS
    """The batch convention the control is written for (``"hf"``: the dict a Hugging Face loop sees)."""
    world_sizes: tuple[int, ...] = ()
    """The world sizes at which it must be rejected (empty: every W >= 2 it is run at): a mistake that depends on W
    (a factor written for W=2) is right at some world sizes, and is judged only where it shows."""
    strategy: str = "ddp"
    """The data-parallel strategy its mistake shows under (``"fsdp2"``: a mistake in FSDP2's own knobs)."""
    objective: str = "token_mean"
    """The declared objective it is judged under (``--objective``): a recipe right for one objective is the control
    of another."""
    mesh: str | None = None
    """The device mesh its mistake shows on (``"dp=2,cp=2"``, :meth:`harness.core.mesh.Mesh.parse`): a count reduced
    over the wrong group of a mesh is right while the world is one data-parallel group. Its world size is the mesh's;
    None: ``dp=W``."""
    model: str | None = None
    """The ``--model`` its mistake needs (``"harness.moe:moe"``: a mixture-of-experts mistake); None: the session's
    model (the built-in one by default)."""
    launch: str = IN_PROCESS
    """How its ranks must be launched for the mistake to show: ``"in-process"`` (the battery's launcher, every rank
    on this machine and on one node), or ``"torchrun-nodes"``: ranks on more than one node (a count reduced over
    the node-local ranks is right while every rank is local), which the in-process battery skips, saying so."""
    library: str | None = None
    """The library its mistake lives in (``"transformers"``: its ``Trainer``, its models), where the control needs
    one the package does not: where it is not installed the control is not run, and the battery says so
    (:func:`unavailable`)."""

    def __post_init__(self) -> None:
        if self.launch not in LAUNCHES:
            msg = f"Target(launch={self.launch!r}) must be one of {', '.join(map(repr, LAUNCHES))}"
            raise ValueError(msg)
        if not isinstance(self.world_sizes, tuple) or any(
                isinstance(w, bool) or not isinstance(w, int) or w < 2 for w in self.world_sizes):
            msg = (f"Target(world_sizes={self.world_sizes!r}) must be a tuple of world sizes >= 2 (where the mistake "
                   "shows), or () for every one")
            raise ValueError(msg)

        if self.mesh is not None:
            layout = Mesh.parse(self.mesh, "Target(mesh=...)")
            if self.world_sizes not in ((), (layout.world_size,)):
                msg = (f"Target(mesh={self.mesh!r}, world_sizes={self.world_sizes!r}): the mesh has "
                       f"{layout.world_size} ranks; leave world_sizes out, the mesh sets it")
                raise ValueError(msg)
            object.__setattr__(self, "world_sizes", (layout.world_size,))

    @property
    def layout(self) -> Mesh | None:
        """Its mesh, parsed (None: ``dp=W``)."""
        return None if self.mesh is None else Mesh.parse(self.mesh, "Target(mesh=...)")

    def judged_at(self, world_sizes: tuple[int, ...]) -> tuple[int, ...]:
        """The world sizes it is judged at, of ``world_sizes`` offered: its declared ones whatever is offered (a
        mistake right at the offered W proves nothing there; a mesh's own), else the offered ones from 2 on."""
        return self.world_sizes or tuple(w for w in world_sizes if w >= 2)


def unavailable(target: Target) -> str | None:
    """Why ``target`` cannot be judged in this environment (None: it can): the library its mistake lives in is not
    installed."""
    if target.library is not None and importlib.util.find_spec(target.library) is None:
        return (f"its target needs {target.library}, which is not installed (pip install .[integrations], or bash "
                "scripts/integrations.sh)")
    return None


@dataclass(frozen=True)
class Entry:
    """A registered control: its class, its target, the signature its gradient's diagnosis must give there (None where
    the run leaves no gradient to read), and whether it is the control only its scenario catches."""

    cls: type
    target: Target
    diagnosis: str | None
    only_its_scenario: bool = False


REGISTRY: dict[str, Entry] = {}
"""Every control by name (``harness.recipes:<name>``), in the order they are defined."""

C = TypeVar("C", bound=type)


def control(target: Target, diagnosis: str | None, *, only_its_scenario: bool = False) -> Callable[[C], C]:
    """Register the decorated class under its ``name``: rejected on ``target``, its gradient diagnosed as
    ``diagnosis``; ``only_its_scenario`` marks the control that passes every other scenario of the battery."""

    def register(cls: C) -> C:
        name = getattr(cls, "name", None)
        if not isinstance(name, str):
            msg = f"{cls.__name__} needs a str `name` to be registered as a control"
            raise TypeError(msg)
        if name in REGISTRY:
            msg = f"control {name!r} is registered twice ({REGISTRY[name].cls.__name__} and {cls.__name__})"
            raise ValueError(msg)
        REGISTRY[name] = Entry(cls, target, diagnosis, only_its_scenario)
        cls.target = target  # type: ignore[attr-defined]
        return cls

    return register


def targets() -> dict[str, Target]:
    return {name: e.target for name, e in REGISTRY.items()}


def diagnoses() -> dict[str, str | None]:
    return {name: e.diagnosis for name, e in REGISTRY.items()}


def scenario_controls() -> dict[str, str]:
    out: dict[str, str] = {}
    for name, e in REGISTRY.items():
        if e.only_its_scenario:
            if e.target.scenario in out:
                first = out[e.target.scenario]
                msg = f"scenario {e.target.scenario!r} has two controls only it catches: {first}, {name}"
                raise ValueError(msg)
            out[e.target.scenario] = name
    return out


__all__ = ["IN_PROCESS", "LAUNCHES", "REGISTRY", "TORCHRUN_NODES", "Entry", "Target", "control", "diagnoses",
           "scenario_controls", "targets", "unavailable"]
