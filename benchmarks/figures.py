"""Every measured figure that README.md and docs/*.md quote from ``benchmarks/results/*.json``, rendered from its file.

    python benchmarks/figures.py --check    # exit 1 listing each figure that differs from its file
    python benchmarks/figures.py --write    # rewrite the documents' figures from the files

``REGISTRY`` holds one ``Figure`` per quoted sentence: the document, the sentence as an *anchor* (its text with a
``{name}`` placeholder for each figure in it), the results file, and the function that turns the file's JSON (a
log's text, for ``gpu-check.log``) into the placeholders' text. An anchor matches its document with any run of
whitespace standing for any other (a sentence may be rewrapped), must match exactly once, and is the figure's own
sentence, so an edit elsewhere in the document leaves it alone. A placeholder is one word (``{name:text}``: several,
on one line; at the end of an anchor: the rest of its line; ``{name:table}``: a whole markdown table); a leading
``^`` ties the anchor to a line's start (a table row).

A results file that does not exist fails the check, unless its entry says ``until_measured`` (the command that
writes it) and the document does not quote the figure yet: that entry is reported as pending and the check passes.
Once the file exists, the document must hold the anchor's sentence.

After re-running a benchmark: ``python benchmarks/figures.py --write``, then commit the results file and the documents
together (``tests/unit/test_figures.py`` runs ``--check``'s logic in the default test tier).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import re
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

Render = Callable[[Any], dict[str, str]]


# --- number formats, as the documents write them -------------------------------------------------------------------

def fixed(x: float, places: int) -> str:
    """``x`` to ``places`` decimals, rounded half up on its shortest decimal form (0.615 -> 0.62, as a reader would),
    not on its binary value (which Python's ``format`` rounds to 0.61)."""
    return str(Decimal(repr(float(x))).quantize(Decimal(1).scaleb(-places), rounding=ROUND_HALF_UP))


def sci(x: float, decimals: int = 1, exp_digits: int = 2) -> str:
    """``x`` in scientific notation: ``sci(0.0368) == '3.7e-02'``, ``sci(8344, 1, 1) == '8.3e3'``."""
    mantissa, exponent = f"{float(x):.{decimals}e}".split("e")
    e = int(exponent)
    return f"{mantissa}e{'-' if e < 0 else ''}{abs(e):0{exp_digits}d}"


def sci_ceil(x: float, decimals: int = 1, exp_digits: int = 1) -> str:
    """An upper bound of ``x`` in scientific notation, rounded up: "within 2.7e-7" for 2.62e-07."""
    e = math.floor(math.log10(abs(x)))
    step = 10.0 ** (e - decimals)
    mantissa = math.ceil(round(abs(x) / step, 6)) * step / 10.0 ** e
    if mantissa >= 10:
        mantissa, e = mantissa / 10, e + 1
    return f"{mantissa:.{decimals}f}e{'-' if e < 0 else ''}{abs(e):0{exp_digits}d}"


def min_s(seconds: float) -> str:
    """``seconds`` as a test time: ``M min SS s``, rounded to the second."""
    whole = int(seconds + 0.5)
    return f"{whole // 60} min {whole % 60:02d} s"


def number(x: float) -> str:
    """A whole number without its ``.0`` (a deadline of 4.0 s is "4 s"), any other as it is."""
    return str(int(x)) if float(x).is_integer() else repr(float(x))


# --- how a results file becomes the text of its figures --------------------------------------------------------------

def _benchmark(name: str) -> ModuleType:
    """A script of ``benchmarks/`` as a module (its ``markdown()`` renders a table): the folder goes on ``sys.path``
    first, as when the script runs, for the ``_common`` it imports."""
    folder = str(Path(__file__).resolve().parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    spec = importlib.util.spec_from_file_location(f"_figures_{name}", Path(folder) / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


OUTCOMES = ("passed", "failed", "skipped", "xfailed", "xpassed", "error", "errors")


def suite_tests(suite: dict[str, Any]) -> int:
    """How many tests the suite's runs judged, any outcome (deselected ones left out); the runs must agree."""
    counts = {sum(int(v) for k, v in (run.get("counts") or run).items() if k in OUTCOMES) for run in suite["runs"]}
    if len(counts) != 1:
        raise ValueError(f"the runs in suite.json disagree on how many tests ran: {sorted(counts)}")
    return counts.pop()


def _suite_counts(suite: dict[str, Any], outcome: str) -> str:
    values = {int((run.get("counts") or run).get(outcome, 0)) for run in suite["runs"]}
    if len(values) != 1:
        raise ValueError(f"the runs in suite.json disagree on how many tests {outcome}: {sorted(values)}")
    return str(values.pop())


def _suite_files_table(suite: dict[str, Any], rows: int = 6) -> str:
    lines = ["| file | seconds | tests | launches |", "| --- | --- | --- | --- |"]
    for f in suite["files"][:rows]:
        lines.append(f"| `{f['file']}` | {fixed(f['seconds'], 1)} | {f['tests']} | {f['launches']} |")
    return "\n".join(lines)


def _battery(data: dict[str, Any], key: str) -> float:
    return float(data["results"][key]["wall_median_s"])


CORRECT = "correct recipe (harness.recipes:global_token_mean)"


def _library_case(data: dict[str, Any], recipe: str, column: str) -> dict[str, Any]:
    row = next(r for r in data["recipes"] if r["recipe"].split(":")[-1] == recipe)
    return dict(row["cases"][column])


def _library_cell(data: dict[str, Any], recipe: str, column: str) -> str:
    return str(_library_case(data, recipe, column)["cell"])


def _library_line(data: dict[str, Any], recipe: str, column: str) -> str:
    return str(_library_case(data, recipe, column)["diagnosis"]["line"])


def _mesh_row(data: dict[str, Any], strategy: str, mesh: str, schedule: str | None = None,
              steps: int = 1) -> dict[str, str]:
    row = next(r for r in data["results"] if r["strategy"] == strategy and r["mesh"] == mesh
               and r.get("pp_schedule") == schedule and r.get("pp_steps", 1) == steps)
    return {"mesh": fixed(row["mesh_s"]["median"], 3), "one_d": fixed(row["one_d_s"]["median"], 3),
            "ratio": fixed(row["ratio"], 2)}


def _mesh_targets(data: dict[str, Any]) -> dict[str, str]:
    mesh = {r["target"] for r in data["results"] if "pp_schedule" not in r and "model" not in r}
    pipeline = {r["target"] for r in data["results"] if "pp_schedule" in r}
    moe = {r["target"] for r in data["results"] if "model" in r}
    if len(mesh) != 1 or len(pipeline) != 1 or len(moe) != 1:
        raise ValueError(f"mesh.json's targets are not one per kind: mesh {sorted(mesh)}, pipeline {sorted(pipeline)}, "
                         f"moe {sorted(moe)}")
    return {"mesh": number(mesh.pop()), "pipeline": number(pipeline.pop()), "moe": number(moe.pop())}


LOGGED = {"mean of the ranks' means": "LoggedMeanOfLocalMeans",
          "mean of the microbatches' means": "LoggedMicrobatchMean",
          "mean of the sequences' means": "LoggedSequenceMean",
          "global token mean (right)": "LoggedGlobalTokenMean"}
LOGGED_COLUMNS = (("user_recipes.models:small_init_lm", "initial"), ("user_recipes.models:small_init_lm", "warmed"),
                  ("built-in", "initial"), ("built-in", "warmed"))


def _logged_row(data: dict[str, Any], label: str) -> dict[str, str]:
    out = {}
    for i, (model, start) in enumerate(LOGGED_COLUMNS):
        row = next(r for r in data["rows"] if r["model"] == model and r["start"] == start)
        out[f"c{i}"] = str(row["scenario_failures_of_12"][LOGGED[label]])
    return out


def _diagnosis_ratios(data: dict[str, Any]) -> tuple[str, str]:
    ratios = [c["ratio"] for c in data["cases"]]
    return fixed(min(ratios), 2), fixed(max(ratios), 2)


def _correct_ratio_error(data: dict[str, Any]) -> str:
    return sci_ceil(max(c["max_ratio_error"] for c in data["cases"]
                        if c["recipe"].endswith(":global_token_mean")))


def _gpu_reference(data: dict[str, Any]) -> dict[str, str]:
    ref = next(r for r in data["reference"] if r["scenario"] == "uneven" and r["window"] == 0)
    return {"error": sci(ref["max_abs_error"], 2), "ratio": fixed(ref["worst_ratio"], 4)}


def _gpu_two_ranks(data: dict[str, Any]) -> dict[str, str]:
    ok, bad = (next(r for r in data["two_ranks_gloo"] if r["device"] == "cuda" and r["recipe"] == name)
               for name in ("global_token_mean", "mean_of_local_means"))
    return {"ok": sci(ok["max_error"], 2), "ok_ratio": fixed(ok["worst_ratio"], 4), "bad": sci(bad["max_error"], 2),
            "bad_ratio": sci(bad["worst_ratio"], 1, 1)}


PYTEST_SUMMARY = re.compile(r"^=*\s*((?:\d+ \w+(?:, )?)+) in ([\d.]+)s\b", re.MULTILINE)


def _pytest_summaries(log: str) -> list[tuple[dict[str, int], float]]:
    """Each pytest summary line of a log (``1 failed, 12 passed, 16 skipped in 29.91s``): its counts and seconds."""
    found = [({word: int(n) for n, word in re.findall(r"(\d+) (\w+)", m.group(1))}, float(m.group(2)))
             for m in PYTEST_SUMMARY.finditer(log)]
    if not found:
        raise ValueError("the log holds no pytest summary line ('N passed ... in S s')")
    return found


def _gpu_lane(log: str) -> dict[str, str]:
    """The first pytest run of ``benchmarks/gpu_check.sh``'s log is the gpu lanes (the skipped tests are ``gpu2``'s,
    on a machine with one device): how many passed of those that ran, in how long."""
    counts, seconds = _pytest_summaries(log)[0]
    ran = sum(counts.get(k, 0) for k in ("passed", "failed", "error", "errors"))
    return {"passed": str(counts.get("passed", 0)), "of": str(ran), "s": fixed(seconds, 1)}


def _reliability(data: dict[str, Any]) -> dict[str, str]:
    m = data["modes"]
    return {"raised": fixed(m["rank_raises"]["median_s"], 2), "died": fixed(m["rank_sigkilled"]["median_s"], 2),
            "skipped": fixed(m["rank_skips_collective"]["median_s"], 2),
            "skipped_deadline": number(m["rank_skips_collective"]["deadline_s"]),
            "past_deadline": number(m["past_deadline"]["deadline_s"]),
            "deadline": fixed(m["past_deadline"]["median_s"], 2),
            "desync": fixed(m["expected_exception_with_grace"]["median_s"], 2)}


def _reliability_totals(data: dict[str, Any]) -> dict[str, str]:
    modes = data["modes"].values()
    return {"seen": str(sum(m["expected_kind_seen"] for m in modes)), "runs": str(sum(m["runs"] for m in modes)),
            "hangs": str(sum(m["hangs"] for m in modes)), "orphans": str(sum(m["orphans"] for m in modes)),
            "leaked": str(sum(m["leaked_folders"] for m in modes))}


KNOBS = {"the correct recipe, default average, W=2": "average, correct recipe, W=2",
         "torchtitan's loss, `reduction = \"sum\"` declared, W=2": "sum declared, torchtitan's loss, W=2",
         "torchtitan's loss under the default average (`sum_loss_under_averaging`), W=2":
             "average, torchtitan's loss, W=2",
         "the knobs set on the root module only (`divide_factor_on_root_only`), W=2": "factor on the root only, W=2",
         "the knobs set on the root module only, W=3": "factor on the root only, W=3"}


def _knobs_row(data: dict[str, Any], key: str) -> str:
    row = data["fsdp2_knobs"][key]
    low, high = row["ratio_min"], row["ratio_max"]
    ratio = repr(float(low)) if low == high else f"{low!r} to {high!r}"
    return f"{row['parity'].upper()} | {sci(row['max_error'])} | {ratio} |"


def _bf16_row(data: dict[str, Any], strategy: str, scenario: str, world: int) -> str:
    r = next(r for r in data["bf16"] if (r["strategy"], r["scenario"], r["world_size"]) == (strategy, scenario, world))
    cells = [sci(r["noise"], 2), sci(r["bound"], 2), sci(r["correct_error"], 2), fixed(r["correct_ratio"], 3),
             sci(r["mean_of_means_error"], 2), fixed(r["mean_of_means_ratio"], 2)]
    return " | ".join(cells) + " |"


def _bf16_scale_row(data: dict[str, Any], scenario: str, world: int) -> str:
    r = next(r for r in data["bf16_scale"]
             if (r["strategy"], r["scenario"], r["world_size"]) == ("ddp", scenario, world))
    cells = [f"{', '.join(map(str, r['counts']))}, {', '.join(map(str, r['counts_bf16']))}",
             sci(r["scale_noise"], 2), sci(r["scale_bound"], 2),
             f"{sci(r['correct_scale_off'])} ({fixed(r['correct_scale_ratio'], 2)})",
             f"{sci(r['bf16_count_scale_off'], 2)} ({fixed(r['bf16_count_scale_ratio'], 2)})",
             f"{sci(r['bf16_count_relative_l2'])}, {sci(r['relative_l2_bound'], 2)}", r["bf16_count_verdict"]]
    return " | ".join(cells) + " |"


def _quick_seconds(data: dict[str, Any]) -> dict[str, str]:
    """A single quick time at the file's top level, under whichever name a results file gives it."""
    for key in ("median_wall_s", "wall_median_s", "median_s"):
        if key in data:
            return {"quick": fixed(data[key], 1)}
    raise KeyError("quick.json holds none of 'median_wall_s', 'wall_median_s', 'median_s' at its top level")


def _quick_and_full(data: dict[str, Any]) -> dict[str, str]:
    """``--quick``'s and the full battery's median wall times for the correct recipe, fresh processes, in one run of
    ``benchmarks/quick_bench.py``, and their ratio."""
    return {"quick": fixed(data["results"]["quick"]["median_s"], 1),
            "full": fixed(data["results"]["full"]["median_s"], 1),
            "ratio": fixed(data["ratio_full_over_quick"], 2)}


# --- the registry --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Figure:
    """One quoted sentence's figures: where they are, which file holds them, how its JSON becomes their text."""

    doc: str  # the document, relative to the repository root
    anchor: str  # the sentence, a {name} per figure; whitespace matches any whitespace
    source: str  # the results file, under benchmarks/results/
    render: Render  # parsed JSON (a log's text, for a file that is not .json) -> {name: text}
    until_measured: str | None = None  # the command that writes `source`, for a file that may not exist yet
    pattern: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "pattern", compile_anchor(self.anchor))

    def __str__(self) -> str:
        return f"{self.doc}: {' '.join(self.anchor.split())[:90]!r} (benchmarks/results/{self.source})"


PLACEHOLDER = re.compile(r"\{(\w+)(?::(table|text))?\}")


def compile_anchor(anchor: str) -> re.Pattern[str]:
    """The anchor as a regular expression: its text literal with any whitespace run matching any whitespace run, each
    ``{name}`` one word (to the line's end where it ends the anchor), ``{name:text}`` words on one line,
    ``{name:table}`` a markdown table; a leading ``^`` ties the anchor to a line's start (a table row)."""
    parts = ["^"] if anchor.startswith("^") else []
    pos = 1 if parts else 0
    for m in PLACEHOLDER.finditer(anchor):
        parts.append(_literal(anchor[pos:m.start()]))
        name = m.group(1)
        if m.group(2) == "table":
            parts.append(rf"(?P<{name}>^\|[^\n]*(?:\n\|[^\n]*)*)")
        elif m.end() == len(anchor):
            parts.append(rf"(?P<{name}>[^\n]*)")
        elif m.group(2) == "text":
            parts.append(rf"(?P<{name}>[^\n]+?)")
        else:
            parts.append(rf"(?P<{name}>\S+?)")
        pos = m.end()
    parts.append(_literal(anchor[pos:]))
    return re.compile("".join(parts), re.MULTILINE)


def _literal(text: str) -> str:
    return "".join(r"\s+" if chunk.isspace() else re.escape(chunk) for chunk in re.split(r"(\s+)", text) if chunk)


def _one(key: str, fn: Callable[[Any], str]) -> Render:
    """A render of one placeholder."""
    return lambda data: {key: fn(data)}


def _bind(fn: Callable[..., Any], *args: Any) -> Callable[[Any], Any]:
    """``fn`` of the parsed file and ``args``: one function serving every row of a table."""
    return lambda data: fn(data, *args)


def _audit_table(d: Any) -> str:
    """The audit benchmark's table: each script alone, audited, and the overhead."""
    rows = ["| script | alone (median) | audited (median) | overhead |", "| --- | --- | --- | --- |"]
    for script, f in d["figures"].items():
        alone, audited = fixed(f["script_alone"]["median_s"], 2), fixed(f["audited"]["median_s"], 2)
        over = f"+{fixed(f['overhead_s'], 2)} s ({fixed(f['ratio'], 2)}x)"
        rows.append(f"| `{script}` | {alone} s | {audited} s | {over} |")
    return "\n".join(rows)


def _audit_span(d: Any) -> dict[str, str]:
    overheads = [f["overhead_s"] for f in d["figures"].values()]
    return {"low": fixed(min(overheads), 1), "high": fixed(max(overheads), 1)}


README = "README.md"
BATTERY = "docs/battery.md"
AUDIT = "docs/audit.md"
FSDP2 = "docs/fsdp2-bf16-clipping.md"

REGISTRY: tuple[Figure, ...] = (
    # README.md: the opening paragraph, the Quick start, the verdict excerpt, the library table, the index.
    Figure(README, "with a two-layer GPT-2 and Llama from transformers, {gpt2} s and {llama} s",
           "model_battery.json", lambda d: {"gpt2": fixed(d["results"]["GPT-2 (2 layers)"]["wall_median_s"], 1),
                                            "llama": fixed(d["results"]["Llama (2 layers)"]["wall_median_s"], 1)}),
    Figure(README, "`--quick` gives a first verdict in {quick} s on the built-in model, the full battery in {full} s",
           "quick.json", _quick_and_full),
    Figure("docs/battery.md", "its last run: `--quick` {quick} s, the full battery {full} s ({ratio}x)", "quick.json",
           _quick_and_full),
    Figure(README, "`bash scripts/test.sh` from a fresh clone: {tests} tests in {time:text} (median of the runs in",
           "suite.json", lambda d: {"tests": str(suite_tests(d)), "time": min_s(d["median_wall_s"])}),
    *(Figure(README, f"{row} | {{cell}}", "libraries.json",
             _one("cell", _bind(_library_cell, "transformers_local_items", column)))
      for row, column in (("parity (uneven, W=2, fp32)", "parity"), ("parity (uneven, W=2, fp64)", "parity fp64"),
                          ("parity (single, W=2, fp32)", "parity single"), ("one_sync (uneven, W=2, fp32)", "one_sync"),
                          ("logged_loss (uneven, W=2, fp32)", "logged_loss"))),
    Figure(README, "note: transformers_local_items, parity (uneven, W=2, fp32): {line}", "libraries.json",
           _one("line", lambda d: _library_line(d, "transformers_local_items", "parity"))),
    Figure(README, "{table:table} In short: transformers' Trainer", "libraries.json",
           _one("table", lambda d: str(_benchmark("library_table").markdown(d)))),
    Figure(README, "the whole battery takes {s} s on 2 CPU cores (median, `python benchmarks/resume_bench.py`",
           "resume_battery.json", _one("s", lambda d: fixed(d["median_battery_s"], 1))),

    # the audit: README.md and docs/audit.md
    Figure(README, "On the tests' scripts the audit adds {low}-{high} s to the script's own two steps", "audit.json",
           _audit_span),
    Figure(AUDIT, "start-up is included in both. {table:table} Every verdict came within {within} s", "audit.json",
           lambda d: {"table": _audit_table(d), "within": str(math.ceil(max(f["audited"]["range_s"][1]
                                                                           for f in d["figures"].values())))}),

    # docs/battery.md
    Figure(BATTERY, "{correct} s for the correct recipe; a recipe whose module imports `matplotlib.pyplot` "
           "{preloaded} s with the module preloaded, {per_launch} s when every rank of every launch imports it "
           "({ratio}x; medians of {n})", "battery.json",
           lambda d: {"correct": fixed(_battery(d, CORRECT), 1),
                      "preloaded": fixed(_battery(d, "heavy-import recipe, module preloaded"), 1),
                      "per_launch": fixed(_battery(d, "heavy-import recipe, imported per launch"), 1),
                      "ratio": fixed(d["ratio_per_launch_over_preloaded"], 1), "n": str(d["repeats"])}),
    *(Figure(BATTERY, f"^| {label} | {{c0}} | {{c1}} | {{c2}} | {{c3}} |", "logged_loss_start.json",
             _bind(_logged_row, label)) for label in LOGGED),
    Figure(BATTERY, "The targets are at most {mesh}x for a mesh case, {pipeline}x for a pipeline and {moe}x for a "
           "mixture-of-experts case over ep against the dense model.", "mesh.json",
           _mesh_targets),
    *(Figure(BATTERY, f"^| {case} | {strategy} | {{mesh}} s | {{one_d}} s | {{ratio}}x |", "mesh.json",
             _bind(_mesh_row, *key))
      for case, strategy, key in (
          ("`dp=2,cp=2`", "DDP", ("ddp", "dp=2,cp=2")),
          ("`dp=2,cp=2`", "FSDP2", ("fsdp2", "dp=2,cp=2")),
          ("`dp_replicate=2,dp_shard=2`", "FSDP2", ("fsdp2", "dp_replicate=2,dp_shard=2")),
          ("`dp=2,pp=2`, GPipe", "DDP stages", ("ddp", "dp=2,pp=2", "gpipe")),
          ("`dp=2,pp=2`, GPipe", "FSDP2 stages", ("fsdp2", "dp=2,pp=2", "gpipe")),
          ("`dp=2,pp=2`, `interleaved1f1b` (2 stages per rank)", "DDP stages", ("ddp", "dp=2,pp=2", "interleaved1f1b")),
          ("`dp=2,pp=2`, 1F1B, 2 schedule steps per window", "DDP stages", ("ddp", "dp=2,pp=2", "1f1b", 2)),
          ("`dp=2,ep=2`, MoE", "DDP", ("ddp", "dp=2,ep=2")),
          ("`dp_shard=2,ep=2`, MoE", "FSDP2", ("fsdp2", "dp_shard=2,ep=2")))),
    Figure(BATTERY, "a median of {tp} s per launch at `dp=2,tp=2` against {dp} s at `dp=4`, {ratio}x (the median "
           "of the {n} pairs' ratios: {pairs}x, from {low}x to {high}x)", "tp_launch.json",
           lambda d: {"tp": fixed(d["dp=2,tp=2"]["median_s"], 2), "dp": fixed(d["dp=4"]["median_s"], 2),
                      "ratio": fixed(d["ratio_tp_over_dp"], 2), "n": str(d["dp=4"]["n"]),
                      "pairs": fixed(d["ratio_of_pairs"]["median"], 2),
                      "low": fixed(d["ratio_of_pairs"]["range"][0], 2),
                      "high": fixed(d["ratio_of_pairs"]["range"][1], 2)}),
    Figure(BATTERY, "{checks} float32 checks): at W=4 the battery took {w4} s in-process (median; {w4_ms} ms per "
           "check) and {torchrun} s inside torchrun as two agents of two workers ({torchrun_ms} ms per check), "
           "{job} s for the whole job", "torchrun_battery.json",
           lambda d: {"checks": str(d["checks"]), "w4": fixed(d["in_process_w4_s"]["median"], 2),
                      "w4_ms": fixed(d["per_check_in_process_ms"], 0),
                      "torchrun": fixed(d["torchrun_2x2_battery_s"]["median"], 1),
                      "torchrun_ms": fixed(d["per_check_torchrun_ms"], 0),
                      "job": fixed(d["torchrun_2x2_job_s"]["median"], 1)}),
    Figure(BATTERY, "at W=8 in-process {w8} s ({w8_ms} ms per check)", "torchrun_battery.json",
           lambda d: {"w8": fixed(d["in_process_w8_s"]["median"], 2),
                      "w8_ms": fixed(d["per_check_in_process_w8_ms"], 0)}),

    # docs/layout.md: the walk before the first rank
    Figure("docs/layout.md", "the flat folder's walk stayed in the preparation {before_prep} times, with "
           "{before_stays} stays and {before_returns} returns over the stages.", "run_walk_231ae05.json",
           lambda d: {"before_prep": str(d["case"]["preparation"]["stays"]),
                      "before_stays": str(d["case"]["stages"]["stays"]),
                      "before_returns": str(d["case"]["stages"]["returns"])}),
    Figure("docs/layout.md", "the preparation is entered once and left once ({after_prep} stay), with {after_stays} "
           "stays and {after_returns} returns over the stages", "run_walk.json",
           lambda d: {"after_prep": str(d["case"]["preparation"]["stays"]),
                      "after_stays": str(d["case"]["stages"]["stays"]),
                      "after_returns": str(d["case"]["stages"]["returns"])}),
    Figure("docs/layout.md", "as long as before, {modules} modules and {module_stays} stays after,", "run_walk.json",
           lambda d: {"modules": str(d["case"]["modules"]), "module_stays": str(d["case"]["stays"])}),
    Figure("docs/layout.md", "against {flat_modules} modules and {flat_stays} stays in the flat folder",
           "run_walk_231ae05.json",
           lambda d: {"flat_modules": str(d["case"]["modules"]), "flat_stays": str(d["case"]["stays"])}),

    # docs/diagnosis.md
    Figure("docs/diagnosis.md", "its last run: {held} of {run} in-process controls read their own cause at the recipe "
           "level over the full battery ({skipped} skipped", "recipe_readings.json",
           lambda d: {"held": str(d["held"]), "run": str(d["run"]), "skipped": str(len(d["skipped"]))}),
    Figure("docs/diagnosis.md", "condition numbers {low} to {high} on the windows of", "diagnosis.json",
           lambda d: {"low": fixed(min(c["condition"] for c in d["cases"]), 1),
                      "high": fixed(max(c["condition"] for c in d["cases"]), 1)}),
    Figure("docs/diagnosis.md", "a diagnosis costs {low}x to {high}x the parity run it explains (medians of {n},",
           "diagnosis.json", lambda d: dict(zip(("low", "high"), _diagnosis_ratios(d)),
                                            n=str({c["diagnosis"]["n"] for c in d["cases"]}.pop()))),
    Figure("docs/diagnosis.md", "where the correct recipe's ratios sit within {error} of 1)", "diagnosis.json",
           _one("error", _correct_ratio_error)),
    Figure("docs/diagnosis.md", "and {low}x to {high}x with the per-row fit", "diagnosis_per_sequence.json",
           lambda d: dict(zip(("low", "high"), _diagnosis_ratios(d)))),

    # docs/fsdp2-bf16-clipping.md (its opening says every figure there is from fsdp2_bf16.json)
    *(Figure(FSDP2, f"^| {label} | {{row}}", "fsdp2_bf16.json", _one("row", _bind(_knobs_row, key)))
      for label, key in KNOBS.items()),
    *(Figure(FSDP2, f"^| {label} | {scenario}, W={world} | {{row}}", "fsdp2_bf16.json",
             _one("row", _bind(_bf16_row, strategy, scenario, world)))
      for label, strategy in (("DDP, autocast", "ddp"), ("FSDP2, params", "fsdp2"))
      for scenario, world in (("uneven", 2), ("long", 2), ("uneven", 3))),
    Figure(FSDP2, "the correct recipe stays at least {below}x below the bound, and the mean of local means at least "
           "{above}x above it (`bf16_worst`)", "fsdp2_bf16.json",
           lambda d: {"below": fixed(d["bf16_worst"]["margin_below"], 2),
                      "above": fixed(d["bf16_worst"]["margin_above"], 2)}),
    *(Figure(FSDP2, f"^| {scenario}, W={world} | {{row}}", "fsdp2_bf16.json",
             _one("row", _bind(_bf16_scale_row, scenario, world)))
      for world in (1, 2, 3, 4) for scenario in ("uneven", "long")),
    Figure(FSDP2, "at 2x its bound or more ({above}x and above on these windows)", "fsdp2_bf16.json",
           _one("above", lambda d: fixed(min(r["mean_of_means_ratio"] for r in d["bf16"]), 1))),
    Figure(FSDP2, "the correct computation's own offset at these weights runs against the rounding's: {ratio}x)",
           "fsdp2_bf16.json", _one("ratio", lambda d: fixed(d["bf16_scale_worst"]["bf16_count_ratio_long"], 2))),

    # docs/gpu.md
    Figure("docs/gpu.md", "the CUDA float32 reference against the CPU float64 one: max abs error {error} (worst ratio "
           "{ratio})", "gpu-probe.json", _gpu_reference),
    Figure("docs/gpu.md", "sharing the GPU over gloo: the correct recipe {ok} (ratio {ok_ratio}), the mean of local "
           "means rejected at {bad} (ratio {bad_ratio})", "gpu-probe.json", _gpu_two_ranks),

    Figure("docs/gpu.md", "the `gpu` lane passed {passed} of {of} in {s} s;", "gpu-check.log", _gpu_lane),
    Figure("docs/gpu.md", "The unit tier passed there too ({unit} tests).", "gpu-check.log",
           _one("unit", lambda log: str(_pytest_summaries(log)[-1][0].get("passed", 0)))),

    # docs/launcher.md
    Figure("docs/launcher.md", "a rank that raises (reported as `raised`, median {raised} s), a SIGKILLed rank "
           "(`died`, {died} s), a skipped collective (`raised` at the process-group timeout, {skipped} s with a "
           "{skipped_deadline} s deadline), a run past its {past_deadline} s deadline (`deadline`, {deadline} s)",
           "reliability.json", lambda d: {k: v for k, v in _reliability(d).items() if k != "desync"}),
    Figure("docs/launcher.md", "lockstep grace (`desync`, {desync} s): {seen} of {runs} with the expected kind, "
           "{hangs} hangs, {orphans} orphan processes, {leaked} leaked folders.", "reliability.json",
           lambda d: {"desync": _reliability(d)["desync"], **_reliability_totals(d)}),
    Figure("docs/launcher.md", "a warm launch of a 2-rank gloo DDP step takes **{warm} s** (median of {warm_n}), the "
           "same step with a fresh `spawn` per launch **{spawn} s** (median of {spawn_n}): **{ratio}x**. The first "
           "launch of a session, which starts the forkserver, took {first} s.", "launch.json",
           lambda d: {"warm": fixed(d["warm"]["median_s"], 3), "warm_n": str(d["warm"]["n"]),
                      "spawn": fixed(d["spawn"]["median_s"], 2), "spawn_n": str(d["spawn"]["n"]),
                      "ratio": fixed(d["ratio_spawn_over_warm"], 0), "first": fixed(d["first_launch_s"], 2)}),
    Figure("docs/launcher.md", "importing `matplotlib.pyplot` takes {without} s when each rank imports it and "
           "{with_} s preloaded ({ratio}x); restarting the server to add the module cost {restart} s once.",
           "preload.json",
           lambda d: {"without": fixed(d["cases"]["matplotlib.pyplot"]["without_preload_median_s"], 3),
                      "with_": fixed(d["cases"]["matplotlib.pyplot"]["with_preload_median_s"], 3),
                      "ratio": fixed(d["cases"]["matplotlib.pyplot"]["ratio_without_over_with"], 1),
                      "restart": fixed(d["cases"]["matplotlib.pyplot"]["server_restart_launch_s"], 2)}),

    # docs/libraries.md
    Figure("docs/libraries.md", "right under its summing reduction (FSDP2), {error} off under DDP's average",
           "libraries.json", _one("error", lambda d: sci(_library_case(d, "torchtitan_loss", "parity")["max_error"],
                                                          1, 1))),
    Figure("docs/libraries.md", "the full battery (`benchmarks/results/examples.json`): {table:table}",
           "examples.json", _one("table", lambda d: str(_benchmark("examples_bench").markdown(d)))),
    Figure("docs/libraries.md", "none of these paths reads them). {table:table}", "packing.json",
           _one("table", lambda d: str(_benchmark("packing_table").markdown(d)))),
    Figure("docs/libraries.md", "The reference is the padded batch (one right-padded row per sequence, its attention "
           "mask), itself {floor} from each sequence run alone.", "packing.json",
           _one("floor", lambda d: sci(max(v for v in d["reference_floor"].values() if v is not None and v < 1e-10)))),

    Figure("docs/libraries.md", "(parity on the uneven scenario, fp32, `benchmarks/results/transformers_moe.json`): "
           "{table:table}", "transformers_moe.json",
           _one("table", lambda d: str(_benchmark("transformers_moe").markdown(d)))),
    Figure("docs/libraries.md", "uniform routing gives k ({uniform} here with the router weights zeroed), not 1 (the "
           "Mixtral's value at initialization is {init});", "transformers_moe.json",
           lambda d: {"uniform": f"{d['aux_loss']['uniform']:.4f}", "init": f"{d['aux_loss']['at_init']:.4f}"}),

    # docs/tests.md
    Figure("docs/tests.md", "`benchmarks/results/suite.json` (commit {commit}): {tests} tests ({passed} passed, "
           "{skipped} skipped:", "suite.json",
           lambda d: {"commit": str(d["commit"]), "tests": str(suite_tests(d)),
                      "passed": _suite_counts(d, "passed"), "skipped": _suite_counts(d, "skipped")}),
    Figure("docs/tests.md", "its reason), {walls:text} wall (median {median} s) on 2 cores, {launches} launches in "
           "the pytest processes, {starts} forkserver starts.", "suite.json",
           lambda d: {"walls": " and ".join(f"{fixed(r['wall_s'], 1)} s" for r in d["runs"]),
                      "median": fixed(d["median_wall_s"], 1), "launches": str(d["launches_in_process"]),
                      "starts": str(d["server_starts"])}),
    Figure("docs/tests.md", "{table:table} CI from a fresh clone", "suite.json", _one("table", _suite_files_table)),
    Figure("docs/tests.md", "`tests/distributed` without the slow tier, {runs} runs in a row", "flake.json",
           _one("runs", lambda d: str(d["runs_done"]))),
    Figure("docs/tests.md", "{green} green ({passed} passed each).", "flake.json",
           lambda d: {"green": str(sum(r["exit_status"] == 0 for r in d["runs"])),
                      "passed": str({r["counts"]["passed"] for r in d["runs"]}.pop())}),

    # docs/training-and-resume.md
    Figure("docs/training-and-resume.md", "the stop / continuous / resume trio through the launcher takes {trio} s "
           "(median; medians of the runs: stop {stop} s, continuous {continuous} s, resume {resume} s) plus {start} s "
           "to start the forkserver once.", "resume_trio.json",
           lambda d: {"trio": fixed(d["median_trio_s"], 1), "stop": fixed(d["median_run_s"]["stop"], 2),
                      "continuous": fixed(d["median_run_s"]["continuous"], 2),
                      "resume": fixed(d["median_run_s"]["resume"], 2), "start": fixed(d["forkserver_start_s"], 2)}),
    Figure("docs/training-and-resume.md", "{trio} s per trio (median), {bad} failed or aborted runs out of {runs}, "
           "resumed checkpoint bitwise equal to the continuous one in {equal} of {repeats}.", "torchrun_trio.json",
           lambda d: {"trio": fixed(d["median_seconds_per_trio"], 1), "bad": str(d["failures"] + d["aborts"]),
                      "runs": str(d["runs"]), "equal": str(d["bitwise_equal"]), "repeats": str(d["repeats"])}),
)


# --- checking and writing ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Outcome:
    """What one entry found: its problems (each fails the check), a pending note, and the edits ``--write`` makes."""

    figure: Figure
    problems: tuple[str, ...] = ()
    pending: str | None = None
    edits: tuple[tuple[int, int, str], ...] = ()  # (start, end, text) in the document


def examine(figure: Figure, text: str, results: Path = RESULTS) -> Outcome:
    """``figure`` against the document ``text`` and its results file under ``results``."""
    path = results / figure.source
    matches = list(figure.pattern.finditer(text))
    if not path.is_file():
        if figure.until_measured is not None and not matches:
            return Outcome(figure, pending=f"{figure}: pending: the file does not exist yet ({figure.until_measured} "
                                           "writes it); once it does, the document must quote the sentence")
        fix = figure.until_measured or "run the benchmark that writes it"
        return Outcome(figure, (f"{figure}: benchmarks/results/{figure.source} does not exist ({fix})",))
    if len(matches) != 1:
        where = "no sentence matches" if not matches else f"{len(matches)} sentences match"
        return Outcome(figure, (f"{figure}: {where} the anchor (it must match exactly once; change the anchor in "
                                "benchmarks/figures.py with the sentence)",))
    try:
        raw = path.read_text()
        expected = figure.render(json.loads(raw) if path.suffix == ".json" else raw)
    except (KeyError, IndexError, StopIteration, TypeError, ValueError) as e:
        return Outcome(figure, (f"{figure}: cannot render from the file: {type(e).__name__}: {e}",))
    m = matches[0]
    problems, edits = [], []
    for name in m.re.groupindex:
        found = m.group(name)
        want = expected.get(name)
        if want is None:
            problems.append(f"{figure}: the render gives no {name!r}")
        elif want != found:
            problems.append(f"{figure}: {name}: expected {want!r}, found {found!r}")
            edits.append((m.start(name), m.end(name), want))
    return Outcome(figure, tuple(problems), None, tuple(edits))


def examine_all(root: Path = ROOT, results: Path | None = None,
                registry: Iterable[Figure] = REGISTRY) -> list[Outcome]:
    """Every entry of ``registry`` against the documents under ``root`` and the files under ``results`` (default
    ``root/benchmarks/results``)."""
    results = root / "benchmarks" / "results" if results is None else results
    texts: dict[str, str] = {}
    out = []
    for figure in registry:
        doc = root / figure.doc
        if not doc.is_file():
            out.append(Outcome(figure, (f"{figure}: {figure.doc} does not exist",)))
            continue
        text = texts.setdefault(figure.doc, doc.read_text())
        out.append(examine(figure, text, results))
    return out


def write(root: Path = ROOT, results: Path | None = None, registry: Sequence[Figure] = REGISTRY) -> list[Outcome]:
    """Rewrite every figure that differs from its file; returns what is left (entries that could not be written)."""
    outcomes = examine_all(root, results, registry)
    by_doc: dict[str, list[tuple[int, int, str]]] = {}
    for o in outcomes:
        by_doc.setdefault(o.figure.doc, []).extend(o.edits)
    for doc, edits in by_doc.items():
        if not edits:
            continue
        text = (root / doc).read_text()
        for start, end, new in sorted(edits, reverse=True):
            text = text[:start] + new + text[end:]
        (root / doc).write_text(text)
    return [o for o in examine_all(root, results, registry) if o.problems or o.pending]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true", help="exit 1 listing each figure that differs from its file")
    mode.add_argument("--write", action="store_true", help="rewrite the documents' figures from the files")
    args = parser.parse_args(argv)
    if args.write:
        write()
    outcomes = examine_all()
    problems = [p for o in outcomes for p in o.problems]
    for line in [o.pending for o in outcomes if o.pending] + problems:
        print(line)
    matching = sum(1 for o in outcomes if not o.problems and not o.pending)
    print(f"figures: {matching} of {len(outcomes)} entries match their files, {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
