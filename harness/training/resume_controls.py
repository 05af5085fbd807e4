"""Negative controls of the resume battery: the harness's own trainer with one real resume mistake each, as
``--trainer=harness.training.resume_controls:<name>``. The battery must fail every one, naming the state that differs
(``tests/distributed/test_resume_battery.py`` shows that it does; ``python -m harness report`` runs them too).

The names are :data:`harness.training.trainer.RESUME_BUGS`; what each one does is documented there.
"""

from __future__ import annotations

from typing import Any

from harness.training.trainer import RESUME_BUGS, HarnessTrainer, trainer_factory

CONTROLS = {bug: f"harness.training.resume_controls:{bug}" for bug in RESUME_BUGS}
"""Each control's ``--trainer`` path, by name."""

CAUGHT_BY = {"not_atomic": ("kill-in-save", "kill-before-commit")}
"""Controls only a kill can catch, and the cases that do: a save that is not atomic with its checkpoint looks right
whenever no save is interrupted. Every other control fails a planned stop and resume already."""


def __getattr__(name: str) -> Any:
    # One zero-argument factory per bug, derived from RESUME_BUGS: a new bug there is a new control here.
    if name in RESUME_BUGS:

        def factory() -> HarnessTrainer:
            return trainer_factory(bug=name)

        factory.__name__ = factory.__qualname__ = name
        return factory
    raise AttributeError(name)


__all__ = ["CAUGHT_BY", "CONTROLS"]
