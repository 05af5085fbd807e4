"""The report's renderers: report.md, report.json and report.png (:mod:`harness.workflow.figures`) from a
:class:`harness.workflow.results.Report`, and the short table the ``report`` command prints."""

from __future__ import annotations

from typing import TYPE_CHECKING

from harness.workflow.figures import write_figure
from harness.workflow.outputs import write_json, write_text

if TYPE_CHECKING:
    from harness.workflow.results import Report

REPORT_FILES = ("report.png", "report.json", "report.md")


def write_report(report: Report) -> None:
    """report.png, report.json and report.md, each written whole through a temporary name (never half a file)."""
    r, out = report.results, report.outputs
    write_figure(out / "report.png", r["tokens_per_window"], r["resume"]["continuous_losses"],
                 r["resume"]["resumed_losses"], r["resume"]["stop_at"])
    write_json(out / "report.json", r)
    write_text(out / "report.md", markdown(report))


def _fmt(x: float) -> str:
    return f"{x:.3e}" if x != 0 else "0"


def markdown(report: Report) -> str:
    r = report.results
    good, bad = r["parity"]["global_token_mean"], r["parity"]["mean_of_local_means"]
    ev, trio = r["evaluate"], r["resume"]
    lines = [
        "# DDP token-mean report",
        "",
        f"Config `{r['config']['path']}`, data lock `{r['prepare']['data_lock'][:16]}...`, "
        f"{r['config']['world_size']} ranks (CPU, gloo). Every number below was computed by this run "
        f"({r['seconds']:.0f} s).",
        "",
        "## Seed 000's three questions",
        "",
        "| question | measured |",
        "| --- | --- |",
        f"| components compared | {good['components']} |",
        f"| tokens per rank in the compared window | {good['rank_tokens']} |",
        f"| max abs error, global token mean (correct) | {_fmt(good['max_abs_error'])} "
        f"({'within' if good['passed'] else 'NOT within'} atol={good['atol']:g}, rtol={good['rtol']:g}) |",
        f"| max abs error, mean of local means (control) | {_fmt(bad['max_abs_error'])} "
        f"({bad['over_tolerance']} components over tolerance) |",
        f"| resume max abs difference at step {trio['updates']} (model, optimizer, scheduler) | "
        f"{trio['max_abs_difference_all']!r} |",
        f"| test loss (per supervised token) | {ev['test_loss']:.5f} |",
        f"| token accuracy | {100 * ev['test_accuracy']:.2f}% |",
        f"| valid test tokens | {ev['test_tokens']} ({ev['test_sequences']} sequences) |",
        "",
        "## Checks",
        "",
        "| check | verdict | detail |",
        "| --- | --- | --- |",
    ]
    lines += [f"| {c.name} | {'PASS' if c.passed else 'FAIL'} | {c.detail} |" for c in report.checks]
    lines += [
        "",
        "## Gradient parity (the plan's first window)",
        "",
        "| normalization | max abs error | worst ratio | over tolerance |",
        "| --- | --- | --- | --- |",
        f"| global token mean | {_fmt(good['max_abs_error'])} | {good['worst_ratio']:.3g} | {good['over_tolerance']} |",
        f"| mean of local means | {_fmt(bad['max_abs_error'])} | {bad['worst_ratio']:.3g} | {bad['over_tolerance']} |",
        "",
        "## Battery (W=2; PASS/FAIL with the max error where there is one)",
        "",
        "```",
        r["battery"]["table"],
        "```",
        "",
        "## Resume",
        "",
        f"Stopped at step {trio['stopped_final_step']}, resumed from step {trio['resumed_start_step']} to "
        f"{trio['updates']}; max abs difference from the continuous run: "
        + ", ".join(f"{k} {v!r}" for k, v in trio["max_abs_difference"].items())
        + f"; loss histories equal: {trio['losses_equal']}.",
        "",
        "## Resume battery (every state, generator, loss and checkpoint label bitwise, per case)",
        "",
        "```",
        r.get("resume_battery", {}).get("table", "(not run)"),
        "```",
        "",
        "## Scaling (CPU figures on this machine, not a GPU prediction)",
        "",
        f"{r['scaling']['device']}. The same training workload (correct recipe, SGD) at each world size; "
        "efficiency = throughput_W / (W * throughput_1) (seed 003).",
        "",
        "| ranks | steps | tokens | seconds | tokens/s | efficiency |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for s in r["scaling"]["rows"]:
        eff = "n/a" if s["efficiency"] is None else f"{s['efficiency']:.2f}"
        lines.append(f"| {s['world_size']} | {s['steps']} | {s['tokens']} | {s['seconds']:.2f} | "
                     f"{s['tokens_per_s']:.0f} | {eff} |")
    lines += ["", "![tokens per rank per window, and loss curves](report.png)", ""]
    return "\n".join(lines)


def summary_table(report: Report) -> str:
    """The short table the command prints at the end (the three questions' numbers)."""
    r = report.results
    good, bad = r["parity"]["global_token_mean"], r["parity"]["mean_of_local_means"]
    ev, trio = r["evaluate"], r["resume"]
    rows = [
        ("components compared", str(good["components"])),
        ("max abs error, global token mean", _fmt(good["max_abs_error"])),
        ("max abs error, mean of means", _fmt(bad["max_abs_error"])),
        (f"resume max abs difference at {trio['updates']}", repr(trio["max_abs_difference_all"])),
        ("test loss", f"{ev['test_loss']:.5f}"),
        ("token accuracy", f"{100 * ev['test_accuracy']:.2f}%"),
        ("valid test tokens", str(ev["test_tokens"])),
    ]
    for s in r["scaling"]["rows"]:
        eff = "" if s["efficiency"] is None else f", efficiency {s['efficiency']:.2f}"
        rows.append((f"CPU throughput at {s['world_size']} rank(s)", f"{s['tokens_per_s']:.0f} tokens/s{eff}"))
    width = max(len(k) for k, _ in rows)
    lines = [f"{k.ljust(width)}  {v}" for k, v in rows]
    lines.append("")
    lines += [f"{'PASS' if c.passed else 'FAIL'}  {c.name}: {c.detail}" for c in report.checks]
    return "\n".join(lines)
