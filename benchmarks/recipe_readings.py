"""The recipe-level diagnosis of every negative control, against the signature it declares: one ``python -m harness
battery --recipe harness.recipes:<name>`` per control, with its target's options (as
:mod:`readings_snapshot` passes them), each failing verdict read as a case of the recipe-level reading
(:mod:`harness.battery.report.recipe_cause`).

    python benchmarks/recipe_readings.py [--quick] [--only NAME,...] [-j 1]

Writes ``benchmarks/results/recipe_readings.json``: per control, the declared signature, the recipe-level cause (or
the lead and the cases that disagree) with its lines, how many cases read each reading on their own windows, and
whether the cause is the control's own (:func:`harness.battery.report.recipe_cause.names_its_cause`). Prints one line
per control and the count that hold. Exit 0 always: this is a measurement; the slow test
``tests/distributed/test_catalog_readings.py`` holds the claim.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from _common import RESULTS, ROOT, command, machine, now, write_result
from readings_snapshot import PACKAGE, _env, battery_options, read_targets, skip_reason

TIMEOUT_S = 1800


def _counts(readings: Any) -> dict[str, int]:
    """How many failing cases read each reading on their own windows."""
    out: dict[str, int] = {}
    for r in readings:
        out[r] = out.get(r, 0) + 1
    return out


def read(name: str, target: dict[str, Any], quick: bool) -> dict[str, Any]:
    """The battery's verdicts on one control and their recipe-level reading."""
    from harness.battery.report.recipe_cause import names_its_cause, readings
    from harness.battery.report.summary import verdict_from_dict

    options = battery_options(target) + (["--quick"] if quick else [])
    with tempfile.TemporaryDirectory(prefix="recipe-readings-") as tmp:
        report = Path(tmp) / "report.json"
        argv = [sys.executable, "-m", "harness", "battery", "--recipe", f"{PACKAGE}:{name}", *options,
                "--battery-keep-going", "--battery-report", str(report)]
        t = time.monotonic()
        done = subprocess.run(argv, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S,
                              check=False)
        took = time.monotonic() - t
        if not report.is_file():
            return {"declared": target.get("diagnosis"), "exit_code": done.returncode, "wall_s": round(took, 1),
                    "error": (done.stdout + done.stderr)[-2000:]}
        data = json.loads(report.read_text())
    verdicts = [verdict_from_dict(v) for v in data.get("checks", [])]
    got = readings(verdicts).get(f"{PACKAGE}:{name}")
    declared = target.get("diagnosis")
    out: dict[str, Any] = {"declared": declared, "exit_code": done.returncode, "wall_s": round(took, 1),
                           "options": options}
    if got is None:
        return {**out, "cause": None, "holds": False, "readings": {}}
    holds = names_its_cause(got, declared, target["check"], target.get("shows_as", "numbers"))
    return {**out, "cause": got.cause, "lead": got.lead, "also": list(got.also), "holds": holds,
            "lines": got.lines(), "readings": _counts(c.reading for c in got.cases)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="run each battery with --quick")
    p.add_argument("--only", metavar="NAME[,NAME]", help="these controls only")
    p.add_argument("-j", "--jobs", type=int, default=1, help="batteries at a time (default: 1)")
    p.add_argument("--out", default=str(RESULTS / "recipe_readings.json"), metavar="FILE")
    args = p.parse_args()
    targets = read_targets()
    names = [n for n in (args.only.split(",") if args.only else targets) if n]
    unknown = [n for n in names if n not in targets]
    if unknown:
        p.error(f"--only: {', '.join(unknown)} not among the {len(targets)} controls")
    skipped = {n: why for n in names if (why := skip_reason(targets[n]))}
    runnable = [n for n in names if n not in skipped]
    results: dict[str, Any] = {}
    start = time.monotonic()

    def one(name: str) -> None:
        r = read(name, targets[name], args.quick)
        results[name] = r
        mark = "ok " if r.get("holds") else "MISS"
        said = "no report" if "error" in r else (r.get("cause") or f"no one cause (lead {r.get('lead')})")
        print(f"{mark} {name}: declared {r['declared']}, recipe-level {said} ({r['wall_s']} s)", flush=True)

    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        for f in [pool.submit(one, n) for n in runnable]:
            f.result()
    held = sum(bool(r.get("holds")) for r in results.values())
    total = time.monotonic() - start
    write_result(Path(args.out), {
        "command": command("benchmarks/recipe_readings.py" + (" --quick" if args.quick else "")),
        "what": "each negative control's recipe-level diagnosis against its declared signature",
        "machine": machine(), "date": now(), "quick": args.quick, "total_s": round(total, 1),
        "held": held, "run": len(results), "skipped": skipped,
        "controls": {n: results[n] for n in runnable if n in results},
    })
    print(f"{held} of {len(results)} controls read their declared signature at the recipe level "
          f"({len(skipped)} skipped), {total:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
