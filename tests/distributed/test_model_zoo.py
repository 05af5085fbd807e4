"""The battery on the models users bring (``tests/user_recipes/zoo.py``) and the habits their loops have
(``tests/user_recipes/loops.py``): every model is judged or refused with its own reason, a model property is named as
one, and what the contract forbids is named as such.

Each test runs real gloo ranks through :func:`harness.battery.launch.runner.run` (cached per case for the session).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from user_recipes import zoo

from harness.battery import scenarios
from harness.battery.judge import checks, registry
from harness.battery.launch import runner
from harness.battery.launch.run import Run
from harness.workflow.cli import main

CORRECT = "harness.recipes:global_token_mean"


def _model(name: str) -> str:
    return f"user_recipes.zoo:{name}"


def test_batchnorm_passes_where_it_can_run_and_a_shape_it_refuses_is_n_a_with_its_own_error() -> None:
    """The correct recipe passes on the BatchNorm model; a window holding a one-row, one-position microbatch is n/a
    for every check, with BatchNorm's message, and no rank starts."""
    assert checks.parity(runner.run(CORRECT, "uneven", 2, model=_model("BatchNormLM"))).passed
    window = scenarios.build("uneven", 2)[0]
    one = window[0][0]
    window[0][0] = type(one)(one.inputs[:1, :1], one.labels[:1, :1])
    run = runner.run_windows(CORRECT, [window], model=_model("BatchNormLM"))
    assert run.records is None and run.failure is None
    for name, check in registry.CHECKS.items():
        verdict = check(run)
        assert "n/a" == verdict.status, name
        assert "Expected more than 1 value per channel" in verdict.message
        assert "rank 0's microbatch 0 (1 row x 1 position)" in verdict.message


@pytest.mark.parametrize("model", ["UnusedHeadLM", "RoutedLM"])
def test_a_parameter_without_a_gradient_turns_on_find_unused_parameters_and_says_so(model: str) -> None:
    """A head no forward uses, or an expert no row of rank 0 reaches: the ranks' DDP gets find_unused_parameters,
    every check passes, and the notes name the parameter as the model's."""
    run = runner.run(CORRECT, "uneven", 2, model=_model(model))
    assert run.find_unused
    for check in ("parity", "one_sync", "ranks_agree", "weights_unchanged"):
        assert registry.CHECKS[check](run).passed, registry.CHECKS[check](run).message
    named = "value_head.weight" if model == "UnusedHeadLM" else "experts.1.weight"
    assert any(named in n and n.startswith("the model's parameter") for n in run.notes)
    assert any("find_unused_parameters=True" in n for n in run.notes)


def test_an_expert_unused_on_one_rank_without_find_unused_is_a_verdict_naming_the_rank_and_the_parameter() -> None:
    """With --find-unused-parameters off the ranks fall out of step (gloo aborts one): the verdict names the
    parameter and the rank that misses its gradient, never a bare SIGABRT. On ``single`` rank 1's synchronizing
    microbatch routes rows to both experts and rank 0's to one (on ``uneven`` rank 1's last microbatch holds no long
    row, so neither rank's synchronizing pass reaches ``experts.1``)."""
    verdict = checks.parity(runner.run(CORRECT, "single", 2, model=_model("RoutedLM"), find_unused="off"))
    assert not verdict.passed and verdict.cause != "numbers"
    assert "experts.1.weight" in verdict.message and "missing on rank 0" in verdict.message
    assert "find_unused_parameters=True" in verdict.message


def test_a_forward_that_reads_the_buffer_it_updates_fails_with_the_buffer_named() -> None:
    """The counter model's parity failure carries the model note: the buffer, and that it is read back."""
    verdict = checks.parity(runner.run(CORRECT, "uneven", 2, model=_model("CountingLM")))
    assert not verdict.passed
    assert "model: the model's forward changes buffer calls" in verdict.message and "reads them back" in verdict.message


def test_the_reference_computes_with_the_ranks_thread_count() -> None:
    """Every forward of the parent's reference ran with one intra-op thread, as the ranks do."""
    zoo.ThreadsSeen.seen.clear()
    runner.run(CORRECT, "single", 2, model=_model("ThreadsSeen"))
    assert zoo.ThreadsSeen.seen and {1} == set(zoo.ThreadsSeen.seen)


def test_a_model_computing_partly_in_float32_reads_the_same_in_the_float64_lane_at_two_and_three_ranks() -> None:
    """The float32 part is the model's, the same on the ranks and in the reference: one verdict whatever W."""
    verdicts = [checks.parity(runner.run(CORRECT, "uneven", w, "fp64", model=_model("Float32InsideLM")))
                for w in (2, 3)]
    assert [True, True] == [v.passed for v in verdicts], [v.message for v in verdicts]
    assert all("float32 tolerances: the model computes part of its forward in float32" in v.message for v in verdicts)


def test_bf16_autocast_fails_the_float32_lane_at_bf16_scale_and_the_float64_lane_says_it_cannot_judge() -> None:
    """fp32: a failure named bf16_computation with the autocast seen; fp64: n/a with the finding ``autocast`` and the
    recipe's line that called the model under it, because CPU autocast leaves float64 alone and that lane would pass a
    computation the recipe never trains with."""
    fp32 = checks.parity(runner.run("user_recipes.loops:BF16Autocast", "uneven", 2, "fp32"))
    assert not fp32.passed and "bf16_computation" == fp32.finding
    assert "autocast (cpu torch.bfloat16, entered around the model call at loops.py:" in fp32.message
    fp64 = checks.parity(runner.run("user_recipes.loops:BF16Autocast", "uneven", 2, "fp64"))
    assert "n/a" == fp64.status and "autocast" == fp64.finding
    assert "autocast (cpu torch.bfloat16, entered around the model call at loops.py:" in fp64.message


def test_the_bf16_finding_is_not_given_to_a_weighting_mistake() -> None:
    """The negative control of the finding: the mean of local means fails the float32 lane without it."""
    verdict = checks.parity(runner.run("harness.recipes:mean_of_local_means", "uneven", 2, "fp32"))
    assert not verdict.passed and verdict.finding is None


def test_weight_decay_inside_the_step_fails_weights_unchanged_and_is_never_read_as_right() -> None:
    """A user's in-place decay: weights_unchanged names the tensors; the later window's parity failure says the
    weights were changed, and its diagnosis reads weights_edited, not correct."""
    run = runner.run("user_recipes.loops:DecayInTheStep", "varying", 2)
    unchanged = checks.weights_unchanged(run)
    assert not unchanged.passed and "tok.weight" in unchanged.message
    parity = checks.parity(run)
    assert not parity.passed and "changed weights in window 0" in parity.message
    assert parity.diagnosis is not None and "weights_edited" == parity.diagnosis["signature"]


@pytest.mark.slow
def test_a_recipe_that_registers_a_comm_hook_is_a_usage_error_saying_the_harness_owns_the_hook(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every check fails with cause "usage" and the harness's sentence; the command line exits 2."""
    verdict = checks.one_sync(runner.run("user_recipes.loops:OwnCommHook", "uneven", 2))
    assert "usage" == verdict.cause
    assert "harness already registered its own DDP communication hook" in verdict.message
    status = main(["battery", "--recipe", "user_recipes.loops:OwnCommHook", "--battery-world-sizes", "2", "--precision",
                   "fp32", "--battery-examples", "0", "--battery-report", str(tmp_path / "r.json")])
    assert 2 == status
    assert "usage error" in capsys.readouterr().err
    assert 2 == json.loads((tmp_path / "r.json").read_text())["exit_status"]


def test_the_command_line_keeps_every_verdict_when_the_model_cannot_run_a_case(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A position table of 64 refuses the battery's long rows: the table prints, the JSON records each n/a with the
    model's error and the model notes, and the exit status is 0 (nothing failed)."""
    out = tmp_path / "r.json"
    status = main(["battery", "--recipe", CORRECT, "--model", _model("ShortPositionsLM"), "--battery-world-sizes", "2",
                   "--precision", "fp32", "--battery-examples", "0", "--battery-report", str(out)])
    printed = capsys.readouterr().out
    assert 0 == status
    assert "n/a" in printed and "about the model" in printed
    report = json.loads(out.read_text())
    assert report["counts"]["n/a"] > 0 and 0 == report["counts"]["fail"]
    assert any("IndexError" in str(c["message"]) for c in report["checks"] if c["status"] == "n/a")
    assert any("refuses some microbatch shapes" in n for n in report["model_notes"])


def test_a_harness_error_on_one_case_is_that_case_s_failing_verdict_and_the_others_still_run(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    """run_cases never loses the battery: an exception inside one case becomes a verdict with cause "error"."""
    from harness.battery.plan import cases as plan
    from harness.battery.plan.options import RunSpec
    from harness.battery.report import table

    cases = [c for c in plan.cases((2,), "fp32") if c.scenario in ("uneven", "single") and c.check == "parity"]
    real = runner.run

    def flaky(spec: RunSpec) -> Run:
        if spec.scenario == "single":
            raise RuntimeError("boom inside the harness")
        return real(spec)

    monkeypatch.setattr(runner, "run", flaky)
    verdicts = table.run_cases(CORRECT, cases)
    by_scenario = {v.scenario: v for v in verdicts}
    assert by_scenario["uneven"].passed
    assert "error" == by_scenario["single"].cause and "boom inside the harness" in by_scenario["single"].message


def test_ddps_unused_parameter_error_gets_the_parameter_names_beside_its_indices() -> None:
    """Under --find-unused-parameters off the second window raises DDP's error, which names indices only: the
    verdict keeps DDP's remedy line and names the value head's tensors."""
    verdict = checks.parity(runner.run(CORRECT, "varying", 2, model=_model("UnusedHeadLM"), find_unused="off"))
    assert not verdict.passed
    assert "find_unused_parameters=True" in verdict.message
    assert "are the model's value_head.weight, value_head.bias" in verdict.message


def test_the_per_parameter_view_names_a_tensor_with_no_gradient_on_some_ranks_only() -> None:
    """The expert hidden from DDP holds a gradient on rank 1 (long rows) and none on rank 0: its rows say so, every
    other tensor's do not."""
    verdict = checks.parity(runner.run(CORRECT, "uneven", 2, model=_model("routed_expert_hidden_from_ddp")))
    assert not verdict.passed and verdict.diagnosis is not None
    notes = {p["name"]: p["note"] for p in verdict.diagnosis["parameters"]}  # type: ignore[union-attr]
    assert notes["experts.1.weight"].startswith("no gradient on rank 0 only")
    assert [] == [n for n, note in notes.items() if "rank 0 only" in note and not n.startswith("experts.1.")]
