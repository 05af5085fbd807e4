"""The battery's last screen, the same on every surface (the command line, pytest's terminal summary, rank 0 under
torchrun): the failing checks grouped by cause, each group once with how many cases and where, its reading and its
fix; what was skipped (``--battery-skip``) and what it would have said; where the full report is.

A failing recipe fails the same way on most cases: a per-microbatch mean fails parity on forty cases with one
diagnosis. Printed once per case that reading hides the one line a user needs (the fix) among hundreds; grouped, the
screen holds one paragraph per mistake, and the full report (every verdict's whole message) is a file it names.

A group is one check of one recipe with one reading: the diagnosis's signature where the failure was diagnosed, else
its named ``finding``, else how the run failed (its ``cause``: a crash, a desync, a deadline), else the check's own
comparison (``numbers``).
"""

from __future__ import annotations

import tempfile
import textwrap
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path

from harness.battery.judge.verdict import FAIL, NOT_APPLICABLE, PASS, SKIPPED, Verdict
from harness.battery.report.recipe_cause import recipe_json, recipe_lines
from harness.battery.report.table import format_table, recipe_names, row_label, write_report, write_text_atomic

WIDTH = 118
"""Where a reading wraps: a long diagnosis stays readable in a terminal, and each line of it counts."""


def verdict_from_dict(data: Mapping[str, object]) -> Verdict:
    """A :class:`Verdict` back from :meth:`Verdict.to_dict` (pytest's verdicts travel as dicts, from xdist workers
    too); keys it does not know (``passed``) are left out."""
    names = {f.name for f in fields(Verdict)}
    kept = {k: v for k, v in data.items() if k in names}
    kept["notes"] = tuple(kept.get("notes") or ())  # type: ignore[arg-type]
    return Verdict(**kept)  # type: ignore[arg-type]


def reading(v: Verdict) -> tuple[str, str]:
    """What groups a failure with others: ``("diagnosis", signature)``, ``("finding", name)``, ``("cause", cause)``
    (how the run failed), or ``("numbers", "")``."""
    if v.diagnosis and v.diagnosis.get("signature"):
        return "diagnosis", str(v.diagnosis["signature"])
    if v.finding:
        return "finding", v.finding
    if v.cause not in (None, "numbers"):
        return "cause", str(v.cause)
    return "numbers", ""


@dataclass(frozen=True)
class Group:
    """The verdicts of one check of one recipe that read the same (:func:`reading`), in the battery's order."""

    recipe: str
    check: str
    key: tuple[str, str]
    verdicts: tuple[Verdict, ...]

    @property
    def first(self) -> Verdict:
        """The representative case: the first in the battery's order, whose numbers the summary shows."""
        return self.verdicts[0]

    @property
    def fix(self) -> str | None:
        """The fix the group's verdicts name (the first that names one; the diagnosis's ``fix`` otherwise)."""
        for v in self.verdicts:
            if v.fix:
                return v.fix
        for v in self.verdicts:
            said = (v.diagnosis or {}).get("fix")
            if said:
                return str(said)
        return None


def group(verdicts: Iterable[Verdict]) -> list[Group]:
    """``verdicts`` grouped by recipe, check and :func:`reading`, groups in the order their first verdict comes."""
    groups: dict[tuple[str, str, tuple[str, str]], list[Verdict]] = {}
    for v in verdicts:
        groups.setdefault((v.recipe, v.check, reading(v)), []).append(v)
    return [Group(recipe, check, key, tuple(vs)) for (recipe, check, key), vs in groups.items()]


def failing_groups(verdicts: Iterable[Verdict]) -> list[Group]:
    return group(v for v in verdicts if v.status == FAIL)


def _join(values: Iterable[object]) -> str:
    return ",".join(map(str, dict.fromkeys(values)))


def where(verdicts: Sequence[Verdict]) -> str:
    """Where a group's cases ran, compactly: world sizes, scenarios, precisions, and the strategies and meshes where
    they are not only DDP over ``dp=W``; the drawn lane by its name."""
    cases = [v for v in verdicts if v.scenario != "drawn"]
    drawn = [v for v in verdicts if v.scenario == "drawn"]
    parts = []
    if cases:
        parts.append("W=" + _join(sorted({v.world_size for v in cases})))
        parts.append(", ".join(dict.fromkeys(v.scenario for v in cases)))
    if drawn:
        parts.append("the drawn layouts")
    parts.append(", ".join(dict.fromkeys(v.precision for v in verdicts)))
    strategies = list(dict.fromkeys(v.strategy for v in verdicts))
    if strategies != ["ddp"]:
        parts.append(", ".join(strategies))
    meshes = [m for m in dict.fromkeys(v.mesh for v in verdicts) if m]
    if meshes:
        parts.append("mesh " + ", ".join(meshes))
    return "; ".join(parts)


def detail(v: Verdict) -> str:
    """A verdict's one-line detail: its message's first line after the check and the case
    (``check parity FAILED: recipe ..., scenario uneven: <detail>``)."""
    lines = v.message.strip().splitlines()
    first = lines[0] if lines else ""
    parts = first.split(": ", 2)
    return parts[-1] if len(parts) == 3 else first


def _wrapped(text: str, indent: str) -> list[str]:
    return textwrap.wrap(text, WIDTH, initial_indent=indent, subsequent_indent=indent + "  ",
                         break_on_hyphens=False) or [indent]


def _cases(n: int) -> str:
    return f"{n} case{'' if n == 1 else 's'}"


def format_group(g: Group, title: str | None = None, indent: str = "", same_fix_as: str | None = None) -> list[str]:
    """One group: the check, how many cases and where; the reading; one case's numbers; the fix when known (said once
    where the group before said the same: ``same_fix_as``)."""
    who = f"{title}: " if title else ""
    lines = _wrapped(f"{who}{g.check} FAILED in {_cases(len(g.verdicts))} ({where(g.verdicts)})", indent)
    v = g.first
    kind, name = g.key
    if kind == "diagnosis":
        lines += _wrapped(str((v.diagnosis or {}).get("line") or f"diagnosis ({name})"), indent + "  ")
        # The diagnosis said why; the case's own numbers are what is left before the message's first "; ".
        lines += _wrapped(f"e.g. {row_label(v)}: {detail(v).split('; ')[0].rstrip(':')}", indent + "  ")
    elif kind == "finding":
        lines += _wrapped(f"finding {name}: {detail(v)}", indent + "  ")
        lines += _wrapped(f"e.g. {row_label(v)}", indent + "  ")
    else:
        how = "" if kind == "numbers" else f"{name}: "
        lines += _wrapped(f"{how}{detail(v)}", indent + "  ")
        lines += _wrapped(f"e.g. {row_label(v)}", indent + "  ")
    if g.fix and g.fix == same_fix_as:
        lines += _wrapped("fix: the same as above", indent + "  ")
    elif g.fix:
        lines += _wrapped(f"fix: {g.fix}", indent + "  ")
    return lines


def format_skipped(verdicts: Sequence[Verdict], titles: Mapping[str, str] | None = None) -> list[str]:
    """Every skipped check (``--battery-skip``) with its reason and what it would have said: failed (each reading
    once, as a failing group), passed, or did not apply."""
    skipped = [v for v in verdicts if v.status == SKIPPED]
    lines: list[str] = []
    by_check: dict[tuple[str, str], list[Verdict]] = {}
    for v in skipped:
        by_check.setdefault((v.recipe, v.check), []).append(v)
    many = len({v.recipe for v in verdicts}) > 1
    for (recipe, check), vs in by_check.items():
        title = f"{(titles or {}).get(recipe, recipe)}: " if many else ""
        reason = vs[0].skip_reason
        failed = [v for v in vs if v.skipped_status == FAIL]
        passed = [v for v in vs if v.skipped_status == PASS]
        na = [v for v in vs if v.skipped_status == NOT_APPLICABLE]
        said = []
        if failed:
            said.append(f"it would have FAILED in {_cases(len(failed))}")
        if passed:
            said.append(f"{'it would have ' if not said else ''}passed in {_cases(len(passed))}")
        if na:
            said.append(f"{'it would ' if not said else ''}not have applied in {_cases(len(na))}")
        lines += _wrapped(f"{title}{check}: skipped (reason: {reason}); " + ", ".join(said), "")
        for g in group(failed):  # each reading once, with where it would have failed
            lines += _wrapped(f"{_cases(len(g.verdicts))} ({where(g.verdicts)}):", "  ")
            lines += format_group(g, None, "  ")[1:]
    return lines


def format_notes(verdicts: Sequence[Verdict], titles: Mapping[str, str] | None = None) -> list[str]:
    """A passing verdict's consequence (the empty window's NaN logged loss beside zero gradients: the optimizer still
    steps), once per recipe and finding, with where it held: the compact table shows no passing row to footnote."""
    noted: dict[tuple[str, str], list[Verdict]] = {}
    for v in verdicts:
        if v.status == PASS and v.finding and v.notes:
            noted.setdefault((v.recipe, v.finding), []).append(v)
    out = []
    for (recipe, _), vs in noted.items():
        title = (titles or {}).get(recipe)
        head = f"{title}: " if title else ""
        out += _wrapped(f"{head}{vs[0].check} ({_cases(len(vs))}: {where(vs)}): {vs[0].notes[0]}", "")
    return out


def format_summary(verdicts: Sequence[Verdict], report: str | Path | None = None,
                   text: str | Path | None = None) -> str:
    """The last screen before the status line: each failing recipe's one cause (the recipe-level diagnosis,
    :mod:`harness.battery.report.recipe_cause`), the failing groups, then what was skipped, then where the full
    report is (``report``, ``text``: the JSON and the messages; None: not written)."""
    recipes = list(dict.fromkeys(v.recipe for v in verdicts))
    titles = recipe_names(recipes) if len(recipes) > 1 else {}
    out: list[str] = []
    leading = recipe_lines(verdicts, titles)
    for line in leading:  # each failing recipe's one cause first
        body = line.lstrip(" ")
        out += _wrapped(body, line[: len(line) - len(body)])
    said = {line.strip()[len("fix: "):] for line in leading if line.strip().startswith("fix: ")}
    groups = failing_groups(verdicts)
    if groups:
        failing = sum(len(g.verdicts) for g in groups)
        out.append(f"failing checks, grouped by cause ({failing} case(s) in {len(groups)} group(s)):")
        previous: str | None = None
        for g in groups:  # a fix said above (by the recipe-level reading or the group before) is not said again
            out += format_group(g, titles.get(g.recipe), "  ", same_fix_as=g.fix if g.fix in said else previous)
            previous = g.fix
    noted = format_notes(verdicts, titles)
    if noted:
        out.append("notes on passing checks (they hold, and say what a training loop would do next):")
        out += ["  " + line for line in noted]
    skipped = format_skipped(verdicts, titles)
    if skipped:
        out.append("skipped (--battery-skip; each check still ran):")
        out += ["  " + line for line in skipped]
    if report is not None:
        out.append(f"full report: {report}" + (f" (every verdict's whole message: {text})" if text else ""))
    return "\n".join(out)


MAX_ROWS = 0
"""The most failing and skipped rows the compact table prints by default: none, since the groups below say where each
reading failed and a real loop's failing rows fill a screen (a recipe wrong everywhere fails over a hundred); one line
counts them, and ``-v`` prints the whole table."""


def compact_table(verdicts: Sequence[Verdict], max_rows: int = MAX_ROWS) -> str:
    """The table's failing and skipped rows (the first ``max_rows``), and one line counting the rest (passing and
    n/a rows, and failing ones past ``max_rows``); ``-v`` prints every row
    (:func:`harness.battery.report.table.format_table`)."""
    marked = list(dict.fromkeys(row_label(v) for v in verdicts if v.status in (FAIL, SKIPPED)))
    shown = set(marked[:max_rows])
    rest = [v for v in verdicts if row_label(v) not in shown]
    kept = [v for v in verdicts if row_label(v) in shown]
    lines = [format_table(kept, notes=False)] if kept else []
    if rest:
        passing = sum(v.status == PASS for v in rest)
        na = sum(v.status == NOT_APPLICABLE for v in rest)
        more = len(marked) - len(shown)
        failing = f"{more}{' more' if kept else ''} failing or skipped (grouped below), " if more else ""
        rows = len({row_label(v) for v in rest})
        lines.append(f"{'and ' if kept else ''}{rows} row(s) not shown: {failing}{passing} pass, {na} n/a "
                     "(-v prints every row)")
    return "\n".join(lines)


def full_text(verdicts: Sequence[Verdict], extra: Sequence[str] = ()) -> str:
    """The full report's text: every row of the table, then every verdict's whole message (a failure's details and
    fix included), then ``extra`` (the controls' lines)."""
    parts = [format_table(verdicts)] if verdicts else []
    for v in verdicts:
        said = v.message
        if v.status == SKIPPED:
            said = f"[skipped: {v.skip_reason}; it would have been {v.skipped_status}]\n{said}"
        if v.fix:
            said += f"\nfix: {v.fix}"
        if v.details:
            said += f"\n\nevery rank's report:\n{v.details}"
        parts.append(said)
    parts += list(extra)
    return "\n\n".join(parts) + "\n"


def text_path(report: str | Path) -> Path:
    """Where the full report's text goes beside its JSON: ``report.json`` -> ``report.txt``, else ``NAME.txt``."""
    path = Path(report)
    return path.with_suffix(".txt") if path.suffix == ".json" else path.with_name(path.name + ".txt")


def write_full_report(report: str | Path | None, payload: Mapping[str, object], verdicts: Sequence[Verdict],
                      extra: Sequence[str] = ()) -> tuple[Path, Path]:
    """Write the JSON report (``--battery-report``'s format, with each failing recipe's ``recipe_level`` reading) to
    ``report``, or to ``report.json`` in a fresh temporary folder when None, and every verdict's whole message beside
    it (:func:`text_path`); returns both."""
    path = Path(report) if report is not None else Path(tempfile.mkdtemp(prefix="harness-battery-")) / "report.json"
    write_report(path, {**payload, "recipe_level": recipe_json(verdicts)})
    text = write_text_atomic(text_path(path), full_text(verdicts, extra))
    return path, text


__all__ = ["Group", "compact_table", "detail", "failing_groups", "format_group", "format_skipped", "format_summary",
           "full_text", "group", "reading", "text_path", "verdict_from_dict", "where", "write_full_report"]
