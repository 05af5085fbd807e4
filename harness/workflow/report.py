"""Seed 000's r1 workflow as one protocol, and the report that answers its three questions.

The questions: does the DDP gradient match the single-device one, does a resumed run land on the continuous run's
bits, and what does the trained model reach on test data. Every number in ``report.md`` / ``report.json`` is computed
by the steps below in the same invocation; none is copied from the seed.

Where the pieces live: the outputs folder and its crash-safe writers in :mod:`harness.workflow.outputs`, the steps in
:mod:`harness.workflow.protocol`, the scaling table in :mod:`harness.workflow.scaling`, the renderers in
:mod:`harness.workflow.render`. Bad input found before ``prepare`` writes anything leaves the folder untouched; bad
input found later (an incomplete checkpoint of the trio) is reported with the files already written.
"""

from __future__ import annotations

import math
import shutil
import time
from collections.abc import Sequence
from pathlib import Path

from harness.data.config import Config
from harness.data.corpus import data_lock, make_corpus
from harness.recipes import CORRECT_RECIPE
from harness.workflow.outputs import BadInput, Progress, check_lock, restore_dir, stderr_progress, swap_dir, temp_dir
from harness.workflow.protocol import (
    MEAN_OF_MEANS,
    PREPARED_FILES,
    REFERENCE_FILES,
    checkpoint_to_evaluate,
    compute_reference,
    ddp_parity,
    evaluate,
    load_reference,
    parity_window,
    plan_token_counts,
    prepare,
    token_counts,
    trio,
)
from harness.workflow.render import REPORT_FILES, write_report
from harness.workflow.results import Check, Report
from harness.workflow.resume import resume_battery
from harness.workflow.scaling import SCALING_STEPS, SCALING_WORLDS, check_worlds, cpu_label, scaling


def _check_controls(controls: Sequence[str] | None) -> list[str]:
    from harness.recipes import NEGATIVE_CONTROLS

    chosen = list(NEGATIVE_CONTROLS if controls is None else controls)
    unknown = [c for c in chosen if c not in NEGATIVE_CONTROLS]
    if unknown or not chosen:
        msg = (f"--battery-controls={','.join(chosen)!r} must name one or more of {', '.join(NEGATIVE_CONTROLS)}; "
               "leave it out to run them all")
        raise BadInput(msg)
    return chosen


def _check_trainer(trainer: str | None) -> str:
    from harness.resume.contract import HARNESS_TRAINER, TrainerError, resolve_factory

    chosen = trainer or HARNESS_TRAINER
    try:
        resolve_factory(chosen)
    except TrainerError as exc:
        raise BadInput(str(exc).replace("--trainer=", "--resume-trainer=")) from None
    return chosen


def run_report(config: Config, config_path: str, outputs: Path, progress: Progress = stderr_progress,
               scaling_worlds: Sequence[int] = SCALING_WORLDS, scaling_steps: int = SCALING_STEPS,
               controls: Sequence[str] | None = None, resume_trainer: str | None = None) -> Report:
    """The whole protocol; writes report.md, report.json and report.png into ``outputs`` and returns the report.

    ``controls`` limits the battery's negative controls (default: every one in ``harness.recipes.NEGATIVE_CONTROLS``).
    ``resume_trainer`` is the trainer the resume battery runs on (default: the harness's own): a control of
    :mod:`harness.training.resume_controls` there turns the report red with the differing state named.
    A :class:`BadInput` raised after ``prepare`` wrote its files names them (relative to ``outputs``).
    """
    chosen = _check_controls(controls)
    trainer = _check_trainer(resume_trainer)
    # Refuse another data lock before anything runs, so a bad --outputs costs nothing and changes nothing.
    check_lock(outputs, data_lock(make_corpus(config), config), config_path)
    check_worlds(config, scaling_worlds)
    restored = restore_dir(outputs / "runs")
    if restored is not None:
        progress(f"[report] put back {outputs / 'runs'} from {restored.name}, left by a command that did not finish")
    written: list[str] = []
    try:
        return _protocol(config, config_path, outputs, progress, scaling_worlds, scaling_steps, chosen, written,
                         trainer)
    except BadInput as exc:
        if not written:
            raise
        msg = (f"{exc}\n(before this was found, the report had written {', '.join(written)} under {outputs}; "
               "everything else there is as it was)")
        raise BadInput(msg) from None


def _protocol(config: Config, config_path: str, outputs: Path, progress: Progress, scaling_worlds: Sequence[int],
              scaling_steps: int, chosen: Sequence[str], written: list[str], trainer: str) -> Report:
    from harness.battery.plan import cases as plan
    from harness.battery.plan.options import BatteryOptions
    from harness.battery.report.table import format_controls, format_table, run_cases, run_controls

    start = time.monotonic()
    n_steps = 9
    report = Report(config_path, outputs)
    r = report.results

    def step(k: int, title: str) -> None:
        progress(f"[report {k}/{n_steps}] {title} ({time.monotonic() - start:.0f} s elapsed)")

    step(1, "prepare: corpus, plan, data lock")
    prepared = prepare(config, outputs, config_path)
    written += PREPARED_FILES
    r["prepare"] = {"data_lock": prepared.lock, "rows": len(prepared.rows), "windows": len(prepared.plan)}

    step(2, "reference: single-device gradient of the plan's first window")
    r["reference"] = compute_reference(config, outputs, prepared)
    written += REFERENCE_FILES
    reference = load_reference(outputs)

    step(3, f"gradient parity on {config.world_size} ranks: correct normalization and mean of means")
    window = parity_window(config, prepared)
    r["parity"] = {}
    for recipe in (CORRECT_RECIPE, MEAN_OF_MEANS):
        ((c, _),) = ddp_parity(config, recipe, [window], [reference["gradient"]])
        r["parity"][recipe.split(":")[-1]] = {**c.to_dict(), "rank_tokens": token_counts(window)}
    good, bad = r["parity"]["global_token_mean"], r["parity"]["mean_of_local_means"]
    report.checks.append(Check("parity of the correct normalization", good["passed"],
                               f"max abs error {good['max_abs_error']:.3e} over {good['components']} components"))
    report.checks.append(Check("mean-of-means control rejected", not bad["passed"],
                               f"max abs error {bad['max_abs_error']:.3e}, {bad['over_tolerance']} over tolerance"))

    step(4, "battery: the correct recipe on every case at W=2, every negative control on its target")
    progress(f"  battery: {CORRECT_RECIPE.split(':')[-1]}")
    verdicts = run_cases(CORRECT_RECIPE, plan.cases([2]))  # default options: the built-in model, DDP
    progress(f"  battery: {len(chosen)} negative control(s)")
    controls_run = run_controls(chosen, BatteryOptions(world_sizes=(2,)))
    r["battery"] = {"table": format_table(verdicts) + "\n\n" + format_controls(controls_run),
                    "verdicts": [v.to_dict() for v in verdicts], "controls": [c.to_dict() for c in controls_run]}
    correct_failed = [f"{v.check} ({v.scenario}, {v.precision})" for v in verdicts if not v.passed]
    unrejected = [c.control for c in controls_run if not c.rejected]
    report.checks.append(Check("battery: correct recipe passes every check", not correct_failed,
                               "every check holds" if not correct_failed else f"failed: {correct_failed}"))
    report.checks.append(Check("battery: every negative control rejected", not unrejected,
                               "each control fails its targeted check" if not unrejected
                               else f"not rejected: {unrejected}"))

    step(5, f"stop at {config.stop_at}, continuous to {config.updates}, resume {config.stop_at} -> {config.updates}")
    runs_tmp = temp_dir(outputs / "runs")
    try:
        result = trio(config, runs_tmp, progress)
        final_dir = checkpoint_to_evaluate(runs_tmp / "resumed")
        step(6, "evaluate the resumed run's last checkpoint on the test split")
        ev = evaluate(config, final_dir, prepared.lock)
    except BaseException:
        # A failed launch leaves the previous report's runs as they were, and no half-trained folder beside them.
        shutil.rmtree(runs_tmp, ignore_errors=True)
        raise
    swap_dir(runs_tmp, outputs / "runs")
    written.append("runs/")
    r["resume"] = result
    report.checks.append(Check("resume equals continuous at the last step",
                               result["max_abs_difference_all"] == 0.0 and result["stopped_checkpoint_complete"],
                               f"max abs difference {result['max_abs_difference_all']!r}"))

    ev["checkpoint"] = str(outputs / "runs" / "resumed" / final_dir.name)
    r["evaluate"] = ev
    report.checks.append(Check("evaluation on the test split", ev["test_tokens"] > 0 and math.isfinite(ev["test_loss"]),
                               f"test loss {ev['test_loss']:.5f} over {ev['test_tokens']} tokens"))

    step(7, f"resume battery of {trainer}: stops, a resume of a resume, kills inside the step and the save")
    check, r["resume_battery"] = resume_battery(trainer, progress=progress)
    report.checks.append(check)

    step(8, f"scaling: {scaling_steps} steps at {list(scaling_worlds)} ranks (CPU)")
    r["scaling"] = {"rows": scaling(config, scaling_worlds, scaling_steps, progress), "device": cpu_label()}

    step(9, "writing " + ", ".join(REPORT_FILES))
    r["tokens_per_window"] = plan_token_counts(prepared)
    r["checks"] = [{"name": c.name, "passed": c.passed, "detail": c.detail} for c in report.checks]
    r["passed"] = report.passed
    r["seconds"] = time.monotonic() - start
    r["config"] = {"path": config_path, **config.to_dict()}
    write_report(report)
    progress(f"[report] done in {time.monotonic() - start:.0f} s")
    return report


__all__ = ["BadInput", "Check", "Report", "run_report"]
