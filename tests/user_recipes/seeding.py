"""Recipes that move the global random generators, or build what moves them (``tests/user_recipes/seeding_lib.py``'s
``Trainer``, whose constructor seeds them), where the hygiene verdict must name the cause: the seeding function, its
caller and the recipe's line; and their negative controls, which leave the generators alone (run by
``tests/distributed/test_hygiene_culprit.py``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from harness.core.microbatch import Microbatch
from harness.recipes import generators_kept
from harness.recipes.correct import GlobalTokenMean
from user_recipes.seeding_lib import Trainer


class TrainerInStep:
    """Builds the library's ``Trainer`` in its step: its constructor seeds every global generator, every window."""

    name = "trainer_in_step"

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch]) -> float | None:
        trainer = Trainer(model)  # the line the hygiene verdict names
        return GlobalTokenMean().backward_window(trainer.model, window)


class TrainerInSetup:
    """Builds the ``Trainer`` once, in ``setup(model)``, without putting the generators back: setup moved them."""

    name = "trainer_in_setup"

    def setup(self, model: nn.Module) -> None:
        self.trainer = Trainer(model)

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch]) -> float | None:
        return GlobalTokenMean().backward_window(self.trainer.model, window)


class TrainerInSetupKept:
    """The fix: the ``Trainer`` built in ``setup(model)`` with the generators put back; the step checks that it is
    handed the very model ``setup`` received (the wrapped one)."""

    name = "trainer_in_setup_kept"

    def setup(self, model: nn.Module) -> None:
        with generators_kept():
            self.trainer = Trainer(model)

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch]) -> float | None:
        if model is not self.trainer.model:
            msg = f"setup() received {type(self.trainer.model).__name__}, backward_window {type(model).__name__}"
            raise AssertionError(msg)
        return GlobalTokenMean().backward_window(model, window)


class GlobalDraw:
    """Draws noise from torch's global generator in its own code (outside the model's forward) and ignores it."""

    name = "global_draw"

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch]) -> float | None:
        torch.randn(3)
        return GlobalTokenMean().backward_window(model, window)


class OwnGenerator:
    """The negative control of both: permutes the microbatches with a generator of its own (the gradient is a sum over
    microbatches, so their order does not change it)."""

    name = "own_generator"

    def __init__(self) -> None:
        self.generator = torch.Generator().manual_seed(0)

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch]) -> float | None:
        order = [window[int(i)] for i in torch.randperm(len(window), generator=self.generator)]
        return GlobalTokenMean().backward_window(model, order)


class TransformersTrainerInStep:
    """Builds a real ``transformers.Trainer`` around the model in its step (the integrations lane): its
    ``__init__`` calls ``transformers.trainer_utils.set_seed``."""

    name = "transformers_trainer_in_step"

    def backward_window(self, model: nn.Module, window: Sequence[Microbatch]) -> float | None:
        import tempfile

        import transformers

        args = transformers.TrainingArguments(output_dir=tempfile.gettempdir(), report_to="none", use_cpu=True)
        transformers.Trainer(model=model.module, args=args)
        return GlobalTokenMean().backward_window(model, window)
