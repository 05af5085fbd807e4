"""What the audit costs over the script's own steps: each test script run as a user runs it, ``torchrun
--nproc-per-node 2 <script> --steps 2``, against ``python -m harness audit --windows 2 -- torchrun --nproc-per-node 2
<script>`` (the same two optimizer steps, then the audit's capture, exchange and float64 reference), alternated so
that both see the same load.

    python benchmarks/audit_bench.py [--repeats 3] [--out benchmarks/results/audit.json]

The scripts are tests/scripts/ddp_train.py, nanogpt_train.py and fsdp2_train.py, and where transformers is installed
(the integrations extra) trainer_train.py and accelerate_train.py. Writes each one's medians, ranges, the audit's
overhead in seconds and the ratio, and whether every audit gave its verdict within 30 s, as JSON, and prints them.
Not a test: nothing here asserts a speed (on a shared machine read the overheads, not the absolute figures).
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
import time

from _common import RESULTS, ROOT, command, machine, now, summary, write_result

SCRIPTS = ROOT / "tests" / "scripts"
LIBRARY_SCRIPTS = ("trainer_train.py", "accelerate_train.py")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
WITHIN_S = 30.0
"""The verdict the audit is meant to give within, on the tiny models of the tests and 2 cores."""


def _run(argv: list[str]) -> float:
    with tempfile.TemporaryDirectory() as where:
        start = time.monotonic()
        done = subprocess.run(argv, cwd=where, capture_output=True, text=True, timeout=600, check=False)
        wall = time.monotonic() - start
    if done.returncode != 0:
        msg = f"{' '.join(argv)} exited {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
        raise SystemExit(msg)
    return wall


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=str(RESULTS / "audit.json"))
    args = p.parse_args()
    scripts = ["ddp_train.py", "nanogpt_train.py", "fsdp2_train.py"]
    if importlib.util.find_spec("transformers") is not None:
        scripts += list(LIBRARY_SCRIPTS)
    figures = {}
    for script in scripts:
        path = str(SCRIPTS / script)
        plain, audited = [], []
        for _ in range(args.repeats):
            plain.append(_run([*TORCHRUN, path, "--steps", "2"]))
            audited.append(_run([sys.executable, "-m", "harness", "audit", "--windows", "2", "--", *TORCHRUN, path]))
        a, b = summary(plain, 2), summary(audited, 2)
        figures[script] = {"script_alone": a, "audited": b, "overhead_s": round(b["median_s"] - a["median_s"], 2),
                           "ratio": round(b["median_s"] / a["median_s"], 2), f"within_{WITHIN_S:g}_s":
                           max(audited) < WITHIN_S}
        print(f"{script}: alone {a['median_s']:.2f} s, audited {b['median_s']:.2f} s (overhead "
              f"{figures[script]['overhead_s']:+.2f} s, {figures[script]['ratio']}x)", flush=True)
    text = write_result(args.out, {"command": command("benchmarks/audit_bench.py"), "machine": machine(),
                                   "date": now(), "windows": 2, "figures": figures})
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
