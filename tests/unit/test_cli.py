"""The command line in-process: every command whose work stays in this process (no ranks, no training), and the
error path of every command, which is decided before any rank starts.

Exit codes: 0 every check holds, 1 a check failed, 2 input that cannot be used (nothing written, outputs untouched).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from harness.resume.checkpoint import MANIFEST, save_checkpoint
from harness.workflow.cli import main
from harness.workflow.figures import write_figure

ROOT = Path(__file__).resolve().parents[2]
MINIMUM = str(ROOT / "configs" / "minimum.yaml")

SMALL = ROOT / "configs" / "small.yaml"


@pytest.fixture
def small() -> str:
    return str(SMALL)


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_check_loss_prints_the_two_averages_of_the_counterexample(capsys: pytest.CaptureFixture[str]) -> None:
    """12 and 36 tokens with sums 12 and 108: mean of means 2.0, global token mean 2.5, exit 0."""
    assert 0 == main(["check-loss", "--config", MINIMUM])
    out = capsys.readouterr().out
    assert "mean of local means: 2.0" in out
    assert "global token mean:   2.5" in out


def test_a_missing_config_is_exit_2_naming_the_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Every command that reads a config refuses a missing one with exit 2 and writes nothing."""
    missing = str(tmp_path / "nope.yaml")
    for command in ("check-loss", "prepare", "reference", "evaluate", "exercise", "check-environment", "report"):
        args = [command, "--config", missing]
        if command not in ("check-loss", "exercise", "check-environment"):
            args += ["--outputs", str(tmp_path / "out")]
        assert 2 == main(args), command
        assert "nope.yaml' does not exist" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_an_invalid_config_is_exit_2_naming_the_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An unknown key is an error that names it, not a silently ignored line."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("seed: 1\nlearning_rate: 0.1\n")
    assert 2 == main(["prepare", "--config", str(bad), "--outputs", str(tmp_path / "out")])
    assert "learning_rate=0.1 is not a config key" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_prepare_saves_corpus_plan_and_data_lock(small: str, tmp_path: Path) -> None:
    """The outputs folder gets the corpus, the plan and a marker holding the data lock."""
    out = tmp_path / "out"
    assert 0 == main(["prepare", "--config", small, "--outputs", str(out)])
    marker = json.loads((out / "outputs.json").read_text())
    assert 64 == len(marker["data_lock"])
    plan = json.loads((out / "data" / "plan.json").read_text())
    assert (20, 2, 2) == (len(plan), len(plan[0]), len(plan[0][0]))
    assert 192 + 16 + 32 == len((out / "data" / "corpus.jsonl").read_text().splitlines())


def test_prepare_refuses_an_outputs_folder_from_another_data_lock_and_leaves_it_untouched(
    small: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Another seed gives another data lock: exit 2, both locks named, not one byte of the folder changed."""
    out = tmp_path / "out"
    assert 0 == main(["prepare", "--config", small, "--outputs", str(out)])
    before = _snapshot(out)
    lock = json.loads((out / "outputs.json").read_text())["data_lock"]
    other = tmp_path / "other.yaml"
    other.write_text(SMALL.read_text().replace("seed: 7", "seed: 8"))
    capsys.readouterr()
    for command in ("prepare", "reference", "report"):
        assert 2 == main([command, "--config", str(other), "--outputs", str(out)]), command
        err = capsys.readouterr().err
        assert f"prepared from data lock {lock}" in err
        assert "gives data lock " in err
    assert before == _snapshot(out)


def test_reference_saves_the_single_device_gradient_of_the_first_window(small: str, tmp_path: Path) -> None:
    """reference writes the flat gradient and its summary; its components match the model's parameter count."""
    out = tmp_path / "out"
    assert 0 == main(["prepare", "--config", small, "--outputs", str(out)])
    assert 0 == main(["reference", "--config", small, "--outputs", str(out)])
    saved = torch.load(out / "reference" / "reference.pt", weights_only=True)
    summary = json.loads((out / "reference" / "reference.json").read_text())
    assert saved["gradient"].numel() == summary["components"]
    assert sum(summary["rank_tokens"]) == summary["tokens"]


def test_reference_before_prepare_is_exit_2_with_the_fix(small: str, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """Without prepared data, reference says to run prepare first."""
    assert 2 == main(["reference", "--config", small, "--outputs", str(tmp_path / "out")])
    assert "run `python -m harness prepare" in capsys.readouterr().err


def _checkpoint(run_dir: Path, step: int) -> Path:
    # Outside a process group save_checkpoint skips its barriers: one process writes a world-size-1 checkpoint.
    return save_checkpoint(run_dir, step, shared={"step": step}, rank_state={"rank": 0}, rank=0, world_size=1)


def test_check_checkpoints_passes_a_run_directory_of_complete_checkpoints(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every step directory with a manifest that vouches for its files: exit 0."""
    for step in (5, 10):
        _checkpoint(tmp_path / "run", step)
    assert 0 == main(["check-checkpoints", "--run-dir", str(tmp_path / "run")])
    assert "2 step directories in 1 run directory, 0 invalid" in capsys.readouterr().out


def test_check_checkpoints_fails_naming_an_incomplete_step_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A step directory without its manifest (a run killed while writing it) fails the check, by name."""
    _checkpoint(tmp_path / "run", 5)
    (_checkpoint(tmp_path / "run", 10) / MANIFEST).unlink()
    assert 1 == main(["check-checkpoints", "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1].startswith("FAILED: check-checkpoints: 1 invalid step directory")
    assert "step-0010" in err.strip().splitlines()[-1]


def test_check_checkpoints_reports_a_temporary_file_a_killed_run_left(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Complete steps, but a stale ``.NAME.tmp-PID`` of a process that is gone: exit 1, the file named."""
    step = _checkpoint(tmp_path / "run", 5)
    stale = step / ".rank-0.pt.tmp-999999999"  # no process has this pid (beyond Linux's pid_max)
    stale.write_bytes(b"half")
    assert 1 == main(["check-checkpoints", "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert f"{stale}: stale temporary file" in err
    assert "0 invalid step directories and 1 other problem(s)" in err.strip().splitlines()[-1]


def test_check_checkpoints_without_a_run_directory_is_exit_2(tmp_path: Path) -> None:
    """Nothing to check is bad input, not a pass."""
    assert 2 == main(["check-checkpoints", "--outputs", str(tmp_path / "empty")])


def test_evaluate_refuses_a_run_whose_newest_checkpoint_is_incomplete(
    small: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Exit 2 naming the incomplete step directory; no rank starts and nothing is written."""
    _checkpoint(tmp_path / "run", 5)
    (_checkpoint(tmp_path / "run", 10) / MANIFEST).unlink()
    before = _snapshot(tmp_path / "run")
    assert 2 == main(["evaluate", "--config", small, "--run-dir", str(tmp_path / "run")])
    assert "newest checkpoint step-0010 is incomplete" in capsys.readouterr().err
    assert before == _snapshot(tmp_path / "run")


def test_evaluate_refuses_a_run_directory_without_checkpoints(small: str, tmp_path: Path) -> None:
    """An empty or missing run directory is exit 2."""
    (tmp_path / "run").mkdir()
    assert 2 == main(["evaluate", "--config", small, "--run-dir", str(tmp_path / "run")])
    assert 2 == main(["evaluate", "--config", small, "--run-dir", str(tmp_path / "missing")])


def test_exercise_refuses_an_accumulation_that_cannot_split_12_tokens(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The exercise's 12 and 36 tokens are split evenly over the microbatches: accumulation 5 cannot be."""
    cfg = tmp_path / "ex.yaml"
    cfg.write_text((ROOT / "configs" / "exercise.yaml").read_text().replace("accumulation: 2", "accumulation: 5"))
    assert 2 == main(["exercise", "--config", str(cfg)])
    assert "accumulation=5 must divide" in capsys.readouterr().err


def test_check_environment_names_python_torch_backends_and_devices(capsys: pytest.CaptureFixture[str]) -> None:
    """Without --dual nothing is launched: the versions, backends and CUDA devices are listed, exit 0."""
    assert 0 == main(["check-environment", "--config", MINIMUM])
    out = capsys.readouterr().out
    assert f"torch       {torch.__version__}" in out
    assert "gloo yes" in out
    assert "cuda " in out


def test_clean_lists_generated_files_and_deletes_nothing_by_default(
    small: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The dry run names each generated item and leaves every byte in place."""
    out = tmp_path / "out"
    assert 0 == main(["prepare", "--config", small, "--outputs", str(out)])
    before = _snapshot(out)
    capsys.readouterr()
    assert 0 == main(["clean", "--scope", "generated", "--outputs", str(out), "--runs", str(tmp_path / "runs")])
    listed = capsys.readouterr().out
    assert f"would delete {out / 'data'}/" in listed
    assert "nothing deleted" in listed
    assert before == _snapshot(out)


def test_clean_yes_deletes_only_what_the_harness_generated(small: str, tmp_path: Path) -> None:
    """--yes removes the generated items; a user's own file in the outputs folder, and anything outside, stay."""
    out = tmp_path / "out"
    assert 0 == main(["prepare", "--config", small, "--outputs", str(out)])
    (out / "my-notes.txt").write_text("mine")
    (tmp_path / "runs" / "stopped").mkdir(parents=True)
    (tmp_path / "runs" / "keep").mkdir()
    assert 0 == main(["clean", "--scope", "generated", "--outputs", str(out), "--runs", str(tmp_path / "runs"),
                      "--yes"])
    assert ["my-notes.txt"] == sorted(p.name for p in out.iterdir())
    assert ["keep"] == sorted(p.name for p in (tmp_path / "runs").iterdir())


def test_clean_leaves_a_folder_that_prepare_did_not_make(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Without the outputs marker the folder may be the user's: nothing in it is listed or deleted."""
    (tmp_path / "out" / "data").mkdir(parents=True)
    assert 0 == main(["clean", "--scope", "generated", "--outputs", str(tmp_path / "out"), "--runs",
                      str(tmp_path / "runs"), "--yes"])
    assert "leaving it alone" in capsys.readouterr().err
    assert (tmp_path / "out" / "data").is_dir()


def test_report_refuses_an_unknown_battery_control_before_running_anything(small: str, tmp_path: Path) -> None:
    """A misspelt control is exit 2 and no outputs folder appears."""
    assert 2 == main(["report", "--config", small, "--outputs", str(tmp_path / "out"),
                      "--battery-controls", "mean_of_means"])
    assert 2 == main(["report", "--config", small, "--outputs", str(tmp_path / "out"), "--scaling-steps", "0"])
    assert not (tmp_path / "out").exists()


def test_battery_refuses_an_unimportable_recipe(capsys: pytest.CaptureFixture[str]) -> None:
    """A --recipe that does not resolve is a usage error (exit 2), found before any rank starts."""
    assert 2 == main(["battery", "--recipe", "no_such_module:recipe"])
    assert "--recipe" in capsys.readouterr().err


def test_the_figure_is_a_png_with_both_panels(tmp_path: Path) -> None:
    """write_figure writes a PNG from token counts and two loss curves."""
    path = write_figure(tmp_path / "fig.png", [[10, 30], [12, 28]], [3.0, 2.5, 2.0, 1.8], [3.0, 2.5, 2.0, 1.8], 2)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_names_the_failing_check_on_the_last_line_and_exits_1(
    small: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """When a check of the protocol fails, the command exits 1 and its last line says which one."""
    import harness.workflow.render as render
    import harness.workflow.report as report

    def fake_run(config: object, config_path: str, outputs: Path, **_: object) -> report.Report:
        r = report.Report(config_path, outputs)
        r.checks = [report.Check("parity of the correct normalization", True, "ok"),
                    report.Check("resume equals continuous at the last step", False, "max abs difference 1e-07")]
        return r

    monkeypatch.setattr(report, "run_report", fake_run)
    monkeypatch.setattr(render, "summary_table", lambda r: "table")
    assert 1 == main(["report", "--config", small, "--outputs", str(tmp_path / "out")])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "FAILED: report: resume equals continuous at the last step (max abs difference 1e-07)" == last


def test_the_default_config_is_the_checkouts_own_when_run_from_elsewhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without --config, outside the checkout's root, the checkout's configs/minimum.yaml is the one read."""
    import argparse

    from harness.workflow.commands import config_path_of

    monkeypatch.chdir(tmp_path)
    path = config_path_of(argparse.Namespace(config=None))
    assert Path(path) == ROOT / "configs" / "minimum.yaml"
    assert 0 == main(["check-loss"])


@pytest.mark.parametrize("option", [["--strategy", "fsdp3"], ["--precision", "fp16"], ["--objective", "median"]])
def test_explain_refuses_a_bad_lane_option_as_the_battery_does(
        capsys: pytest.CaptureFixture[str], option: list[str]) -> None:
    """--strategy, --precision and --objective are one set of options: the same exit 2 and the same message from
    explain as from the battery, decided before any rank starts."""
    said = []
    for command in (["battery", "--recipe", "harness.recipes:global_token_mean"],
                    ["explain", "--recipe", "harness.recipes:global_token_mean"]):
        try:
            status = main([*command, *option])
        except SystemExit as exc:  # argparse's own refusal of a value outside --strategy's choices
            status = int(exc.code or 0)
        last = capsys.readouterr().err.strip().splitlines()[-1]
        said.append((status, last.split("error: ", 1)[-1]))  # after argparse's "python -m harness <command>: "
    assert 2 == said[0][0] == said[1][0]
    assert said[0][1] == said[1][1]
    assert option[0] in said[1][1] and option[1] in said[1][1]


def test_explain_writes_advice_in_the_strategy_s_own_form() -> None:
    """A sentence naming no_sync() reads set_requires_gradient_sync(False) under FSDP2 (with the helper that does
    either); under DDP it is left as it is (the control)."""
    from harness.workflow.explain import in_strategy_form

    sentence = "the first backward ran inside no_sync() and was never synchronized"
    fsdp2 = in_strategy_form(sentence, "fsdp2")
    assert "no_sync()" not in fsdp2 and "set_requires_gradient_sync(False)" in fsdp2
    assert "harness.recipes.sync_context(model, i, n)" in fsdp2
    assert sentence == in_strategy_form(sentence, "ddp")
