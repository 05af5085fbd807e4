"""What the battery says about each recipe, written down so that two checkouts can be compared verdict by verdict: the
correct recipe and every negative control, each judged by a fresh ``python -m harness battery`` process.

    python benchmarks/readings_snapshot.py [--out benchmarks/results/readings] [--only NAME,...] [-j 1]
    python benchmarks/readings_snapshot.py --compare DIR_A DIR_B

The correct recipe (``harness.recipes:global_token_mean``) runs the full default battery. Each control of
``harness.recipes.controls.REGISTRY`` runs the full battery as a recipe under test (``--recipe
harness.recipes:<name>``), with the options its target needs for its mistake to show: ``--batch-format``,
``--strategy``, ``--objective`` and ``--mesh`` when they differ from the defaults, and its precision added to the
default lanes when they lack it. A control whose target needs ranks on several nodes (``launch="torchrun-nodes"``) is
not run and is listed as skipped. A recipe that the pre-flight stops (no report written) is run a second time with
``--battery-keep-going``, so that its verdicts are kept too.

The harness is reached only through its command line, and the controls' targets are read in a child process through
``harness.recipes.controls``. Every battery runs with ``CI=true`` (the drawn layouts derandomized: the same on every
run) and ``PYTHONHASHSEED=0``.

From each battery report the snapshot keeps, per verdict, its check, case, status, cause, message, fix and diagnosis
(name, sentence, fix), and the report's counts, errors, notes and exit status; of a stopped pre-flight, what the
command printed. Texts are normalized so that only a change in behaviour shows: file paths and line numbers, temporary
folders, durations, process ids, ports and addresses are replaced by placeholders, and so are the ranks that timing
picks (a desync's leading rank, the rank a usage error names of all that raised it); a hygiene control's figures
(errors, ratios, worst window) are left out, since its global random draw changes them from run to run
(:func:`drawn_figures`). One JSON per recipe is written under ``--out`` with ``index.json`` (the command, the machine,
the date, each recipe's exit status and wall time, the skipped controls). ``--compare`` prints every difference
between two such folders (recipe, check, case, field: before vs after; normalized again under the current rules) and
exits 1 when there is one, 0 when they are identical; the index's timings are not compared, nor the recipes that a run
with ``--only`` was not asked for.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from _common import RESULTS, ROOT, command, machine, now, write_result

CORRECT = "global_token_mean"
PACKAGE = "harness.recipes"
DEFAULT_LANES = ("fp32", "fp64")
"""The precision lanes of the battery's default ``--precision both``."""
DEFAULTS = {"batch_format": "harness", "strategy": "ddp", "objective": "token_mean"}
"""The battery's defaults for the options a target may set; a target's value is passed only where it differs."""
OPTION = {"batch_format": "--batch-format", "strategy": "--strategy", "objective": "--objective"}
IN_PROCESS = "in-process"
INDEX = "index.json"
TIMEOUT_S = 1800

_TARGETS = """
import dataclasses, json
from harness.recipes.controls import REGISTRY
print(json.dumps({name: {**dataclasses.asdict(e.target), "diagnosis": e.diagnosis} for name, e in REGISTRY.items()}))
"""
"""Run in a child process: every control's target and declared diagnosis, in the registry's order."""


# --- normalization -------------------------------------------------------------------------------------------------

_TMP = re.escape(tempfile.gettempdir().rstrip("/"))
_RULES: tuple[tuple[re.Pattern[str], str], ...] = (
    # A traceback's frame: the file and line go, the function name stays.
    (re.compile(r'File "[^"\n]*", line \d+'), 'File "<file>", line <n>'),
    # Any other path of a Python file, with a line number after it or not (``/x/harness/battery/run.py:123``,
    # ``run.py, line 12``).
    (re.compile(r"(?:[\w.~+-]*/)*[\w.+-]+\.pyc?\b(?::\d+(?::\d+)?|, line \d+)?"), "<file>"),
    (re.compile(r"\bline \d+\b"), "line <n>"),
    # Temporary folders and files (the reports, the launcher's scratch folders).
    (re.compile(rf"(?:{_TMP}|/tmp|/var/tmp|/dev/shm)/[^\s'\",:;)\]]*"), "<tmp>"),
    # Durations: "14.0 s", "0.35s", "120 ms", "1:02:03".
    (re.compile(r"\b\d+(?:\.\d+)?(?:e-?\d+)? ?(?:ms|seconds|s)\b"), "<duration>"),
    (re.compile(r"\b\d+:\d\d:\d\d(?:\.\d+)?\b"), "<duration>"),
    # Process ids, ports, addresses, thread ids.
    (re.compile(r"\b(pid|PID|process|Process)([ =:]+)\d+"), r"\1\2<pid>"),
    (re.compile(r"\bpid\b(\D{0,3})\d+"), r"pid\1<pid>"),
    (re.compile(r"\b(?:localhost|127\.0\.0\.1|0\.0\.0\.0|\[::1?\]):\d+"), "<host:port>"),
    (re.compile(r"\b(MASTER_PORT|port)([ =:]+)\d+"), r"\1\2<port>"),
    (re.compile(r"\b0x[0-9a-fA-F]{6,}\b"), "<address>"),
    # A desync's leading rank is the rank whose notice the launcher read first among those ahead, and the report
    # lists rank 0 with "(nothing reported)" when it was not the leader: both depend on timing.
    (re.compile(r"^[ \t]*rank \d+: \(nothing reported\)\n", re.MULTILINE), ""),
    (re.compile(r"\brank \d+(:? )(finished step|ended its function)"), r"rank <leader>\1\2"),
    # A usage error names the first rank whose report the launcher read, of every rank that raised it.
    (re.compile(r"\busage error on rank \d+"), "usage error on rank <first>"),
)
"""(pattern, replacement), applied in order to every text kept."""

_FIGURES: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"\b(error|ratio) (?:\d+(?:\.\d+)?(?:e[+-]?\d+)?|inf|nan)\b"), r"\1 <x>"),  # "worst ratio 0" too
    (re.compile(r"(?<![\w.])\d+(?:\.\d+)?e[+-]?\d+\b|(?<![\w.])\d+\.\d+\b"), "<x>"),
    (re.compile(r"\bwindow \d+"), "window <k>"),
)
"""Further rules for a recipe whose figures are drawn (:func:`drawn_figures`): every error and ratio, every decimal
number, and the window a verdict names as its worst."""


def drawn_figures(target: dict[str, Any] | None) -> bool:
    """Whether a recipe's figures differ from run to run by design: a control whose target check is ``hygiene``
    draws from a global random generator that nothing seeds the same way twice (``python_random_shuffle`` reorders
    the microbatches with it, and a sum in another order rounds otherwise), so its errors, ratios and worst window
    are not kept (its statuses and every other text are)."""
    return target is not None and target.get("check") == "hygiene"


def normalize(text: str, figures: bool = False) -> str:
    """``text`` with what differs from run to run of the same code (and from one module layout to another) replaced
    by placeholders: file paths and line numbers, temporary folders, durations, pids, ports, addresses, a desync's
    leading rank; with ``figures``, decimal numbers and the worst window too."""
    for pattern, replacement in _RULES + (_FIGURES if figures else ()):
        text = pattern.sub(replacement, text)
    return text


def _norm(value: Any, figures: bool = False) -> Any:
    """``value`` with every string in it normalized (lists and dicts walked)."""
    if isinstance(value, str):
        return normalize(value, figures)
    if isinstance(value, list):
        return [_norm(v, figures) for v in value]
    if isinstance(value, dict):
        return {k: _norm(v, figures) for k, v in value.items()}
    return value


def case_label(v: dict[str, Any]) -> str:
    """A verdict's case, as one label: the verdict's own label where it has one (a drawn lane), else its scenario,
    world size, precision, strategy and mesh (``uneven, W=2, fp32, ddp``)."""
    if v.get("label"):
        return str(v["label"])
    mesh = f", mesh {v['mesh']}" if v.get("mesh") else ""
    return f"{v.get('scenario')}, W={v.get('world_size')}, {v.get('precision')}, {v.get('strategy')}{mesh}"


def reading(diagnosis: Any) -> Any:
    """A verdict's diagnosis as its name, its sentence and its fix (None where the verdict has none)."""
    if not isinstance(diagnosis, dict):
        return diagnosis
    return {"name": diagnosis.get("signature"), "sentence": diagnosis.get("line"), "fix": diagnosis.get("fix")}


VERDICT_FIELDS = ("status", "cause", "reading", "fix", "message")
"""What the snapshot keeps of each verdict besides its check and case."""


def verdicts_of(report: dict[str, Any], figures: bool = False) -> list[dict[str, Any]]:
    """The verdicts of a battery report, each reduced to its check, case and :data:`VERDICT_FIELDS`, normalized; a
    case that occurs twice for the same check gets `` #2``, `` #3``, ... in the order of the report."""
    out = []
    seen: dict[tuple[str, str], int] = {}
    for v in report.get("checks", []):
        check, case = str(v.get("check")), normalize(case_label(v))
        n = seen[(check, case)] = seen.get((check, case), 0) + 1
        kept = {"status": v.get("status"), "cause": v.get("cause"), "reading": reading(v.get("diagnosis")),
                "fix": v.get("fix"), "message": v.get("message")}
        out.append({"check": check, "case": case if n == 1 else f"{case} #{n}", **_norm(kept, figures)})
    return out


REPORT_FIELDS = ("exit_status", "counts", "expected", "run", "errors", "model_notes", "world_sizes", "precision",
                 "batch_format")
"""What the snapshot keeps of a battery report besides its verdicts."""


def controls_of(report: dict[str, Any], figures: bool = False) -> list[Any]:
    """The report's control results, normalized (empty for a recipe under test)."""
    return _norm(report.get("controls") or [], figures)


# --- running ---------------------------------------------------------------------------------------------------------

def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env["CI"] = "true"  # the drawn layouts derandomized: the same layouts on every run
    env["PYTHONHASHSEED"] = "0"
    return env


def read_targets() -> dict[str, dict[str, Any]]:
    """Every control's target (and declared diagnosis), by name, read in a child process."""
    done = subprocess.run([sys.executable, "-c", _TARGETS], cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=300, check=False)
    if done.returncode != 0:
        raise SystemExit(f"could not read harness.recipes.controls.REGISTRY:\n{done.stderr[-3000:]}")
    targets: dict[str, dict[str, Any]] = json.loads(done.stdout.strip().splitlines()[-1])
    return targets


def battery_options(target: dict[str, Any] | None) -> list[str]:
    """The ``python -m harness battery`` options a control's target needs for its mistake to show (none for the
    correct recipe): its batch format, strategy and objective where they are not the defaults, its mesh, and its
    precision added to the default lanes where they lack it. Its world sizes are among the default 1,2,3,4, or its
    mesh's."""
    if target is None:
        return []
    out: list[str] = []
    for key, flag in OPTION.items():
        if target.get(key, DEFAULTS[key]) != DEFAULTS[key]:
            out += [flag, str(target[key])]
    if target.get("mesh"):
        out += ["--mesh", str(target["mesh"])]
    if target.get("model"):
        out += ["--model", str(target["model"])]
    if target.get("precision", "fp32") not in DEFAULT_LANES:
        out += ["--precision", ",".join([*DEFAULT_LANES, target["precision"]])]
    return out


def skip_reason(target: dict[str, Any]) -> str | None:
    """Why a control is not run here, or None: its ranks must be on several nodes, or it needs a GPU."""
    if target.get("launch", IN_PROCESS) != IN_PROCESS:
        return (f"its target needs launch={target['launch']!r}: ranks on more than one node, which the in-process "
                "battery does not run")
    device = target.get("device")
    if device not in (None, "cpu"):
        return f"its target needs device={device!r}"
    return None


def _battery(recipe: str, options: list[str], folder: Path, tag: str, figures: bool) -> dict[str, Any]:
    """One ``python -m harness battery --recipe RECIPE OPTIONS --battery-report FILE`` in a fresh process."""
    report = folder / f"{tag}.json"
    argv = ["battery", "--recipe", recipe, *options]
    done = subprocess.run([sys.executable, "-m", "harness", *argv, "--battery-report", str(report)], cwd=ROOT,
                          env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
    run: dict[str, Any] = {"argv": ["python", "-m", "harness", *argv, "--battery-report", "<report>"],
                           "exit_code": done.returncode}
    if report.is_file():
        data = json.loads(report.read_text())
        run["report"] = {k: _norm(data.get(k), figures) for k in REPORT_FIELDS}
        run["verdicts"] = verdicts_of(data, figures)
        run["controls"] = controls_of(data, figures)
    else:  # stopped before any verdict (the pre-flight, bad input): what it said is the behaviour
        run["said"] = {stream: normalize(text, figures).splitlines()
                       for stream, text in (("stdout", done.stdout), ("stderr", done.stderr))}
    return run


def snapshot(name: str, target: dict[str, Any] | None) -> dict[str, Any]:
    """Every verdict the battery gives ``harness.recipes:<name>`` (a control on its target's options), normalized;
    a recipe stopped by the pre-flight is run again with ``--battery-keep-going``."""
    recipe = f"{PACKAGE}:{name}"
    options, figures = battery_options(target), drawn_figures(target)
    with tempfile.TemporaryDirectory(prefix="readings-") as tmp:
        runs = [_battery(recipe, options, Path(tmp), "battery", figures)]
        if "report" not in runs[0] and runs[0]["exit_code"] == 1:
            runs.append(_battery(recipe, [*options, "--battery-keep-going"], Path(tmp), "keep-going", figures))
    return {"recipe": recipe, "target": target, "runs": runs}


def _write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")


def run_all(names: list[str], targets: dict[str, dict[str, Any]], out: Path, jobs: int) -> dict[str, Any]:
    """Snapshot each of ``names`` (``jobs`` at a time) into ``out``; return the index's entries by name."""
    start = time.monotonic()
    lock = threading.Lock()
    done = [0]
    entries: dict[str, Any] = {}

    def one(name: str) -> None:
        t = time.monotonic()
        data = snapshot(name, targets.get(name))
        took = time.monotonic() - t
        _write_json(out / f"{name}.json", data)
        runs = data["runs"]
        codes = [r["exit_code"] for r in runs]
        entry: dict[str, Any] = {"file": f"{name}.json", "exit_codes": codes,
                 "verdicts": sum(len(r.get("verdicts", [])) for r in runs), "wall_s": round(took, 1)}
        with lock:
            entries[name] = entry
            done[0] += 1
            elapsed = time.monotonic() - start
            print(f"[{done[0]}/{len(names)}] {name}: exit {','.join(map(str, codes))}, "
                  f"{entry['verdicts']} verdicts, {took:.1f} s (elapsed {_clock(elapsed)})", flush=True)

    if jobs <= 1:
        for name in names:
            one(name)
    else:
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            for f in [pool.submit(one, n) for n in names]:
                f.result()
    return {n: entries[n] for n in names}


def _clock(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


# --- comparing -------------------------------------------------------------------------------------------------------

def _flat(data: dict[str, Any]) -> dict[tuple[str, str, str], Any]:
    """A recipe's snapshot as (check, case, field) -> value: each run's verdicts under their check and case, its
    report's fields and what it said under ``(report)``, ``(controls)`` and ``(said)``."""
    out: dict[tuple[str, str, str], Any] = {("(recipe)", "", "target"): data.get("target")}
    for i, run in enumerate(data.get("runs", [])):
        run_tag = "" if i == 0 else " [keep-going]"
        out[("(run)", run_tag.strip(), "argv")] = run.get("argv")
        out[("(run)", run_tag.strip(), "exit_code")] = run.get("exit_code")
        for key, value in (run.get("report") or {}).items():
            out[("(report)", run_tag.strip(), key)] = value
        for stream, lines in (run.get("said") or {}).items():
            out[("(said)", run_tag.strip(), stream)] = "\n".join(lines)
        for k, c in enumerate(run.get("controls") or []):
            out[("(controls)", f"{k}{run_tag}", "result")] = c
        for v in run.get("verdicts", []):
            for field in VERDICT_FIELDS:
                out[(v["check"], v["case"] + run_tag, field)] = v.get(field)
    return out


def _show(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    return text if "\n" not in text else "\n      " + text.replace("\n", "\n      ")


def differences(a: Path, b: Path) -> Iterable[str]:
    """Every difference between two snapshot folders, one line (or block) each."""
    index_a, index_b = (_index(d) for d in (a, b))

    def asked(name: str) -> bool:  # asked of both runs (a run with --only was asked for its names only)
        return all(i.get("only") is None or name in i["only"] for i in (index_a, index_b))

    skipped_a, skipped_b = index_a.get("skipped", {}), index_b.get("skipped", {})
    for name in sorted(n for n in set(skipped_a) | set(skipped_b) if asked(n)):
        if skipped_a.get(name) != skipped_b.get(name):
            yield f"{name}: skipped: {_show(skipped_a.get(name))} vs {_show(skipped_b.get(name))}"
    files_a = {p.name for p in a.glob("*.json") if p.name != INDEX}
    files_b = {p.name for p in b.glob("*.json") if p.name != INDEX}
    for name in sorted(n for n in files_a ^ files_b if asked(n[:-5])):
        yield f"{name[:-5]}: only in {a if name in files_a else b}"
    for name in sorted(files_a & files_b):
        # Normalized again: a folder written before a rule was added compares under today's rules.
        data_a, data_b = (json.loads((d / name).read_text()) for d in (a, b))
        figures = drawn_figures(data_a.get("target")) or drawn_figures(data_b.get("target"))
        flat_a = {k: _norm(v, figures) for k, v in _flat(data_a).items()}
        flat_b = {k: _norm(v, figures) for k, v in _flat(data_b).items()}
        for key in sorted(set(flat_a) | set(flat_b)):
            before, after = flat_a.get(key, "<missing>"), flat_b.get(key, "<missing>")
            if before != after:
                check, case, field = key
                yield f"{name[:-5]} | {check} | {case} | {field}: {_show(before)}\n    vs {_show(after)}"


def _index(folder: Path) -> dict[str, Any]:
    path = folder / INDEX
    return json.loads(path.read_text()) if path.is_file() else {}


def compare(a: Path, b: Path) -> int:
    """Print every difference between the snapshot folders ``a`` (before) and ``b`` (after); 1 when any."""
    for d in (a, b):
        if not d.is_dir():
            print(f"{d}: not a folder", file=sys.stderr)
            return 2
    found = 0
    for line in differences(a, b):
        found += 1
        print(line)
    recipes = len({p.name for p in a.glob("*.json")} & {p.name for p in b.glob("*.json")} - {INDEX})
    print(f"{found} difference(s) over {recipes} recipe(s) in both {a} and {b}")
    for d in (a, b):
        only = _index(d).get("only")
        if only is not None:
            print(f"{d} was run with --only ({len(only)} recipe(s)): recipes it was not asked for are not compared")
    return 1 if found else 0


# --- main ------------------------------------------------------------------------------------------------------------

def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(RESULTS / "readings"), metavar="DIR",
                   help="folder for the snapshot (default: benchmarks/results/readings/)")
    p.add_argument("--only", metavar="NAME[,NAME]",
                   help=f"snapshot only these recipes of {PACKAGE} ({CORRECT} or control names)")
    p.add_argument("-j", "--jobs", type=int, default=1, help="batteries run at a time (default: 1)")
    p.add_argument("--compare", nargs=2, metavar=("DIR_A", "DIR_B"),
                   help="print every difference between two snapshot folders; exit 1 when any")
    args = p.parse_args()
    if args.compare:
        return compare(Path(args.compare[0]), Path(args.compare[1]))
    if args.jobs < 1:
        p.error(f"--jobs={args.jobs} must be at least 1")
    targets = read_targets()
    everything = [CORRECT, *targets]
    names = everything
    if args.only:
        names = [n for n in args.only.split(",") if n]
        unknown = [n for n in names if n not in everything]
        if unknown:
            p.error(f"--only: {', '.join(unknown)} not among {CORRECT} and the {len(targets)} controls")
    skipped = {n: why for n in names if n in targets and (why := skip_reason(targets[n]))}
    runnable = [n for n in names if n not in skipped]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for n, why in skipped.items():
        print(f"{n}: skipped: {why}", flush=True)
    print(f"{len(runnable)} recipe(s) to run, {len(skipped)} skipped, {args.jobs} at a time; writing to {out}",
          flush=True)
    start = time.monotonic()
    entries = run_all(runnable, targets, out, args.jobs)
    total = time.monotonic() - start
    write_result(out / INDEX, {
        "command": command("benchmarks/readings_snapshot.py"),
        "what": "what the battery says about the correct recipe and each negative control (python -m harness battery "
                "--recipe harness.recipes:NAME, a control with its target's options), normalized: one file per "
                "recipe; compare two folders with --compare",
        "machine": machine(),
        "date": now(),
        "jobs": args.jobs,
        "only": names if args.only else None,
        "total_s": round(total, 1),
        "recipes": entries,
        "skipped": skipped,
    })
    print(f"{len(entries)} recipe(s) in {_clock(total)} ({total:.0f} s), {len(skipped)} skipped; index: "
          f"{out / INDEX}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
