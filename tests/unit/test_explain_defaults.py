"""``explain`` on a negative control reads it where its mistake shows: the options not given come from the control's
target (its mesh, model, strategy, scenario, precision); a given option wins, and any other recipe gets the plain
defaults (the control of the filling)."""

from __future__ import annotations

import argparse

import pytest

from harness.workflow.cli import build_parser
from harness.workflow.explain import control_defaults


def parsed(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["explain", *argv])


def test_a_mesh_control_takes_its_target_s_mesh_model_and_strategy() -> None:
    args = parsed("--recipe", "harness.recipes:router_token_balance_over_local_tokens")
    said = control_defaults(args)
    assert (args.mesh, args.model, args.strategy) == ("dp=2,tp=2", "harness.moe_tp:moe", "fsdp2")
    assert (args.scenario, args.precision, args.objective, args.batch_format) == ("uneven", "fp32", "token_mean",
                                                                                 "harness")
    assert said is not None and "--mesh dp=2,tp=2 --model harness.moe_tp:moe --strategy fsdp2" in said


def test_a_given_option_wins_over_the_target() -> None:
    args = parsed("--recipe", "harness.recipes:router_balance_every_microbatch", "--scenario", "uneven")
    said = control_defaults(args)
    assert "uneven" == args.scenario  # the target's is long
    assert said is not None and "--scenario" not in said and "--model harness.moe:moe" in said


@pytest.mark.parametrize("recipe", ["harness.recipes:global_token_mean", "mypkg.steps:recipe"])
def test_a_recipe_that_is_no_control_gets_the_plain_defaults(recipe: str) -> None:
    args = parsed("--recipe", recipe)
    assert control_defaults(args) is None
    assert (args.scenario, args.mesh, args.model, args.strategy, args.precision) == ("uneven", None, None, "ddp",
                                                                                   "fp32")
