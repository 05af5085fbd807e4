"""The watch of the global random generators around a recipe's call (``harness.battery.rank.rng_watch``): a move is
explained by the seeding call that made it, its callers and the recipe's line, or as a draw and where it was seen; the
wrapped entry points are put back even when the call raises, and the watched call computes what it computes
unwatched. Every test runs inside ``generators_kept``: the generators it moves on purpose are put back."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn
from user_recipes import seeding_lib

from harness.battery.rank.rng_watch import GeneratorWatch, hygiene_fix, moved_detail
from harness.recipes import generators_kept
from harness.recipes.contract import setup_takes_mesh, setup_takes_model


def _build_trainer() -> None:
    seeding_lib.Trainer(nn.Linear(2, 2))  # the recipe's line


class _Noisy(nn.Module):
    """A model whose forward draws from torch's global generator (as a dropout with p > 0 does)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.rand(x.shape)


def test_a_library_seeding_call_names_the_function_its_caller_and_the_recipes_line() -> None:
    """``Trainer(...)`` seeds the three generators through ``set_seed``: one move names the three entry points,
    ``set_seed`` with its file and line, ``Trainer.__init__``, and the recipe's line with its text."""
    with generators_kept(), GeneratorWatch() as watch:
        _build_trainer()
    assert ("python random", "numpy", "torch CPU") == watch.moved
    (move,) = watch.moves
    assert "seeded" == move.kind
    assert ("random.seed", "numpy.random.seed", "torch.manual_seed") == move.entries
    said = moved_detail(watch.moved, watch.moves)
    assert "called by `user_recipes.seeding_lib.set_seed` (user_recipes/seeding_lib.py:16)" in said
    assert "called from `Trainer.__init__` (user_recipes/seeding_lib.py:26)" in said
    assert "in _build_trainer: `seeding_lib.Trainer(nn.Linear(2, 2))  # the recipe's line`" in said
    assert "Trainer(...) seeds the global generators" in hygiene_fix(watch.moves)


def _step(model: nn.Module, draw: bool = False) -> None:
    model(torch.zeros(2))  # the recipe's call of the model
    if draw:
        torch.randn(1)


def test_a_draw_outside_the_model_is_told_apart_from_a_draw_inside_its_forward() -> None:
    """No seeding call: a draw in the recipe's code, beside a forward that draws nothing, is "outside the model's
    forward"; a draw in the forward names the recipe's line that called the model."""
    quiet = nn.Identity()
    with generators_kept(), GeneratorWatch(quiet) as watch:
        _step(quiet, draw=True)
    said = moved_detail(watch.moved, watch.moves)
    assert "torch CPU: drawn from (no seeding call was made), outside the model's forward" in said
    noisy = _Noisy()
    with generators_kept(), GeneratorWatch(noisy) as watch:
        _step(noisy)
    said = moved_detail(watch.moved, watch.moves)
    assert "drawn from (no seeding call was made), inside the model's forward" in said
    assert "in _step: `model(torch.zeros(2))  # the recipe's call of the model`" in said
    assert hygiene_fix(watch.moves).startswith("draw from a generator of its own")


def test_a_seed_set_through_an_unwatched_reference_is_not_called_a_draw() -> None:
    """``torch.default_generator.manual_seed`` escapes the wrapped attributes; torch's changed initial seed says it
    was seeded all the same."""
    with generators_kept(), GeneratorWatch() as watch:
        torch.default_generator.manual_seed(123)
    assert ("unwatched",) == tuple(m.kind for m in watch.moves)


def test_generators_put_back_and_calls_that_change_nothing_are_no_move() -> None:
    """The negative control: a seeding call inside a block that restores the generators, and a draw from a
    generator of its own, move nothing."""
    with GeneratorWatch() as watch:
        with generators_kept():
            _build_trainer()
        torch.randperm(4, generator=torch.Generator().manual_seed(0))
    assert () == watch.moved and () == watch.moves


def test_the_entry_points_are_put_back_even_when_the_call_raises() -> None:
    """Each wrapped attribute is the original function again after a call that raised."""
    originals = (torch.manual_seed, random.seed, torch.random.set_rng_state, torch.cuda.manual_seed_all)
    with pytest.raises(ZeroDivisionError), generators_kept(), GeneratorWatch():
        assert torch.manual_seed is not originals[0]
        _ = 1 / 0
    assert originals == (torch.manual_seed, random.seed, torch.random.set_rng_state, torch.cuda.manual_seed_all)


def test_a_watched_call_computes_what_it_computes_unwatched() -> None:
    """Seeding then drawing under the watch gives the same numbers as without it."""
    with generators_kept():
        torch.manual_seed(7)
        random.seed(7)
        want = (torch.rand(3), random.random())
        with GeneratorWatch():
            torch.manual_seed(7)
            random.seed(7)
            got = (torch.rand(3), random.random())
    assert torch.equal(want[0], got[0]) and want[1] == got[1]


def test_setup_receives_the_model_and_the_mesh_when_it_takes_those_keywords() -> None:
    """``setup(self, model)`` takes the model, ``setup(self, mesh=None)`` the mesh, ``setup(self)`` neither."""

    class Both:
        def setup(self, model: nn.Module, mesh: object = None) -> None: ...

    class Neither:
        def setup(self) -> None: ...

    assert (True, True) == (setup_takes_model(Both()), setup_takes_mesh(Both()))
    assert (False, False) == (setup_takes_model(Neither()), setup_takes_mesh(Neither()))
