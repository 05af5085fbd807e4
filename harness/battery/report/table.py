"""The battery without pytest (the command line's ``battery`` and the report): the plan's cases for recipes under
test, the controls on their targets, and tables and JSON of the verdicts."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from harness.battery.diagnose.of_run import diagnose
from harness.battery.judge import registry
from harness.battery.judge.verdict import FAIL, NOT_APPLICABLE, PASS, SKIPPED, Verdict
from harness.battery.launch import runner
from harness.battery.plan import cases as plan
from harness.battery.plan.options import BatteryOptions
from harness.recipes import CONTROLS
from harness.recipes.catalog import IN_PROCESS, unavailable

Progress = Callable[[str], None]

SCHEMA = "harness.battery-report/1"
"""The ``--json`` and ``--battery-report`` format (the pytest plugin writes the same)."""


def run_cases(recipe: str, cases: Sequence[plan.Case], options: BatteryOptions | None = None,
              progress: Progress | None = None) -> list[Verdict]:
    """Every case for one recipe under test, under ``options`` (default
    :class:`~harness.battery.plan.options.BatteryOptions`); runs shared by several checks launch once. Whatever one case
    does, the others still run: an error of the harness itself on a case becomes that case's failing verdict (cause
    ``"error"``, the traceback in ``details``), never a lost battery."""
    options = options or BatteryOptions()
    verdicts = []
    for case in cases:
        if progress:
            progress(f"{recipe.split(':')[-1]}: {case.check} ({case.id})")
        try:
            run = runner.run(options.spec(recipe, case.scenario, case.world_size, case.precision,
                                          strategy=case.strategy, mesh=case.mesh))
            verdicts.append(registry.CHECKS[case.check](run))
        except Exception as exc:
            verdicts.append(error_verdict(recipe, case, exc))
    return verdicts


def error_verdict(recipe: str, case: plan.Case, exc: BaseException) -> Verdict:
    """A case the harness itself failed on: a failing verdict that says so, with the traceback for ``-v``."""
    import traceback

    text = str(exc).strip().splitlines()
    message = (f"check {case.check} FAILED: recipe {recipe}, world {case.world_size}, {case.precision}, "
               f"{case.strategy}, scenario "
               f"{case.scenario}: the harness raised {type(exc).__name__}: {text[0] if text else ''} while running "
               "this case (not a verdict on the recipe; please report it with the details)")
    return Verdict(case.check, recipe, case.scenario, case.world_size, case.precision, FAIL, message, cause="error",
                   details="".join(traceback.format_exception(exc)), strategy=case.strategy)


@dataclass(frozen=True)
class ControlResult:
    """One negative control judged on its target case: rejected only when the targeted check failed the way the
    control's mistake shows (its numbers, or the desync it causes), not by a crash or anything else."""

    control: str
    verdict: Verdict
    shows_as: str
    diagnosis: dict[str, object] | None = None
    """The diagnosis of the run's gradient (whatever the targeted check): None where the run left none."""

    @property
    def signature(self) -> str | None:
        return None if self.diagnosis is None else str(self.diagnosis["signature"])

    @property
    def rejected(self) -> bool:
        return self.verdict.status == FAIL and self.verdict.cause == self.shows_as

    def to_dict(self) -> dict[str, object]:
        return {"control": self.control, "rejected": self.rejected, "shows_as": self.shows_as,
                "verdict": self.verdict.to_dict(), "diagnosis": self.diagnosis}


def run_controls(names: Sequence[str], options: BatteryOptions | None = None,
                 progress: Progress | None = None) -> list[ControlResult]:
    """Each control on its target (check, scenario, precision, batch format) at each of ``options.world_sizes``
    where its mistake can show (2+), under ``options`` (its model included: None, the built-in one).

    A control whose target declares its world sizes (:attr:`harness.recipes.Target.world_sizes`: a mistake right at
    the W its author tested) runs at those, whatever ``options.world_sizes`` holds: at another W it would pass, and
    its result would say nothing. A control whose target needs ranks on several nodes (``launch="torchrun-nodes"``:
    every in-process rank is on one node, where its mistake is right) is not run here, nor one whose library is not
    installed (:func:`harness.recipes.catalog.unavailable`); ``progress`` is told so."""
    options = options or BatteryOptions()
    unknown = [n for n in names if n not in CONTROLS]
    if unknown:
        msg = f"--battery-controls: {', '.join(unknown)} not among the negative controls: {', '.join(CONTROLS)}"
        raise ValueError(msg)
    out = []
    for name in names:
        target = CONTROLS[name]
        if target.launch != IN_PROCESS:
            if progress:
                progress(f"{name}: skipped, its target needs launch={target.launch!r} (ranks on more than one node; "
                         "every in-process rank is on one node, where its mistake is right)")
            continue
        missing = unavailable(target)
        if missing is not None:
            if progress:
                progress(f"{name}: skipped, {missing}")
            continue
        # Several controls are right at W=1 (no rank to average over): they target W >= 2.
        for world in target.judged_at(options.world_sizes):
            if progress:
                where = f"W={world}" if target.mesh is None else f"W={world} {target.mesh}"
                progress(f"{name}: {target.check} ({target.scenario}, {where}, {target.precision})")
            spec = options.spec(f"harness.recipes:{name}", target.scenario, world, target.precision,
                                batch_format=target.batch_format, strategy=target.strategy,
                                objective=target.objective, mesh=target.layout, model=target.model)
            run = runner.run(spec)
            verdict = registry.CHECKS[target.check](run)
            found = verdict.diagnosis
            if found is None:
                read = diagnose(run)
                found = None if read is None else read.to_dict()
            out.append(ControlResult(name, verdict, target.shows_as, found))
    return out


def _cell(v: Verdict) -> str:
    if v.status == NOT_APPLICABLE:
        return "n/a"
    if v.status == SKIPPED:  # what it would have said stays on the row: a skip hides no failure
        would = {FAIL: "FAIL", NOT_APPLICABLE: "n/a"}.get(str(v.skipped_status), "PASS")
        return f"SKIP ({would})"
    text = "PASS" if v.status != FAIL else "FAIL"
    if v.status == FAIL and v.cause not in (None, "numbers"):
        return f"{text} ({v.cause})"
    if v.max_error is not None:
        text += f" {v.max_error:.1e}"
    return text


def row_label(v: Verdict) -> str:
    """A verdict's row in the table: its ``label`` (the drawn lane's one row per run), else its case."""
    way = "" if v.strategy == "ddp" else f", {v.strategy}"
    where = f"W={v.world_size}" if v.mesh is None else f"W={v.world_size} {v.mesh}"
    return v.label or f"{v.check} ({v.scenario}, {where}, {v.precision}{way})"


def recipe_names(recipes: Sequence[str]) -> dict[str, str]:
    """Each recipe's column title: its ``name`` attribute (:func:`harness.recipes.load_recipe`; the path's attribute
    when it has none or cannot be loaded); recipes that share a name get their module appended, then their path."""
    from harness.recipes import load_recipe

    names = {}
    for r in recipes:
        try:
            name = getattr(load_recipe(r), "name", None)
        except Exception:
            name = None
        names[r] = name if isinstance(name, str) and name else r.split(":")[-1]
    for widen in ("module", "path"):
        counts: dict[str, int] = {}
        for n in names.values():
            counts[n] = counts.get(n, 0) + 1
        names = {r: (f"{n} ({r.split(':')[0]})" if widen == "module" else r) if counts[n] > 1 else n
                 for r, n in names.items()}
    return names


def format_table(verdicts: Sequence[Verdict], notes: bool = True) -> str:
    """Rows are cases (the drawn lane: one row), columns recipes, titled by their ``name``; a cell is PASS/FAIL with
    the max error where there is one, n/a, or SKIP with what it would have been. ``notes``: a footnote per failing
    row's reading (off where :mod:`harness.battery.report.summary` says each reading once)."""
    recipes = list(dict.fromkeys(v.recipe for v in verdicts))
    keys = list(dict.fromkeys(row_label(v) for v in verdicts))
    cell = {(v.recipe, row_label(v)): v for v in verdicts}
    titles = recipe_names(recipes)
    names = [titles[r] for r in recipes]
    first = max(len(k) for k in keys)
    widths = [max(len(n), 17) for n in names]
    lines = [" | ".join(["check".ljust(first), *(n.ljust(w) for n, w in zip(names, widths))])]
    lines.append("-+-".join(["-" * first, *("-" * w for w in widths)]))
    footnotes = []
    # An n/a with a finding says why, once per recipe and reason (the float64 lane's parity under autocast: the note
    # names the autocast and where it was entered), not once per case.
    skipped: dict[tuple[str, str], list[str]] = {}
    # A pass that carries a consequence (the empty window's NaN logged loss: skip the optimizer step) says it once per
    # recipe and finding, with the cases it holds in.
    noted: dict[tuple[str, str], tuple[list[str], str]] = {}
    for key in keys:
        parts = [key.ljust(first)]
        for recipe, width in zip(recipes, widths):
            v = cell.get((recipe, key))
            parts.append(("" if v is None else _cell(v)).ljust(width))
            if v is not None and v.status == NOT_APPLICABLE and v.finding:
                skipped.setdefault((recipe, v.message.split(": ", 2)[-1]), []).append(key)
            elif v is not None and v.status == PASS and v.finding and v.notes:
                noted.setdefault((recipe, v.finding), ([], v.notes[0]))[0].append(key)
            elif notes and v is not None and (v.finding or v.diagnosis):
                said = str(v.diagnosis["line"]) if v.diagnosis else str(v.finding)
                footnotes.append(f"{titles[recipe]}, {key}: {said}")
        lines.append(" | ".join(parts))
    for (recipe, _), (where, said) in noted.items():
        footnotes.append(f"{titles[recipe]}, {where[0]}{f' and {len(where) - 1} more' if len(where) > 1 else ''}: "
                         f"{said}")
    for (recipe, why), where in skipped.items():
        footnotes.append(f"{titles[recipe]}, n/a in {where[0]}"
                         f"{f' and {len(where) - 1} more' if len(where) > 1 else ''}: {why}")
    return "\n".join(lines + [f"  note: {f}" for f in footnotes])


def format_controls(results: Sequence[ControlResult]) -> str:
    """One line per control and world size: its target, the verdict there, whether it was rejected, and what the
    diagnosis reads in its gradient."""
    rows = [(r.control, f"{r.verdict.check} ({r.verdict.scenario}, W={r.verdict.world_size}, {r.verdict.precision}):",
             _cell(r.verdict), "rejected" if r.rejected else "NOT REJECTED",
             f"diagnosis: {r.signature}" if r.signature else "no gradient to read") for r in results]
    if not rows:
        return ""
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row[:4], widths)) + "  " + row[4] for row in rows)


def report_json(recipes: Sequence[str], verdicts: Sequence[Verdict], expected: int, exit_status: int,
                errors: Sequence[str] = (), controls: Sequence[ControlResult] = (),
                world_sizes: Sequence[int] = (), precision: str = "both", model: str | None = None,
                batch_format: str = "harness", model_notes: Sequence[str] = ()) -> dict[str, object]:
    """The battery report of the command line's verdicts (:func:`report_payload`)."""
    return report_payload(recipes=recipes, checks=[v.to_dict() for v in verdicts], expected=expected,
                          exit_status=exit_status, errors=errors, controls=[c.to_dict() for c in controls],
                          world_sizes=world_sizes, precision=precision, model=model, batch_format=batch_format,
                          model_notes=model_notes)


def report_payload(*, recipes: Sequence[str], checks: Sequence[Mapping[str, object]], expected: int,
                   exit_status: int, errors: Sequence[str] = (), controls: Sequence[Mapping[str, object]] = (),
                   world_sizes: Sequence[int] = (), precision: str = "both", model: str | None = None,
                   batch_format: str = "harness", model_notes: Sequence[str] = ()) -> dict[str, object]:
    """The one battery report (:data:`SCHEMA`), for ``--json`` and pytest's ``--battery-report`` alike: what ran
    against what was expected (on which model, with which batch format, at which world sizes and precision), what the
    probe found about the model, every verdict (:meth:`Verdict.to_dict`), the controls, errors outside a verdict and
    the exit status."""
    statuses = [str(c.get("status")) for c in checks]
    return {
        "schema": SCHEMA,
        "recipes": list(recipes),
        "model": model,
        "batch_format": batch_format,
        "model_notes": list(model_notes),
        "world_sizes": list(world_sizes),
        "precision": precision,
        "expected": expected,
        "run": len(checks),
        "counts": {s: statuses.count(s) for s in ("pass", "fail", "n/a", "skipped")},
        "errors": list(errors),
        "exit_status": exit_status,
        "checks": [dict(c) for c in checks],
        "controls": [dict(c) for c in controls],
    }


def write_report(path: str | Path, payload: Mapping[str, object]) -> Path:
    """Write a report atomically (:func:`write_text_atomic`) as indented JSON."""
    return write_text_atomic(path, json.dumps(payload, indent=2) + "\n")


def write_text_atomic(path: str | Path, text: str) -> Path:
    """Write ``text`` atomically: a temporary file beside ``path``, flushed to disk, then renamed over it (a reader
    sees the old file or the new one, never half of one); its folder is made if missing."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        fd = os.open(out.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return out
