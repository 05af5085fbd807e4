"""How much a fresh DDP wrapper changes a run: a model re-wrapped at step 13 of 20, against one wrapper kept.

    python benchmarks/ddp_rewrap.py [--worlds 2,3,4]

Prints, per world size and DDP option, the largest difference of the final weights (a 16-32-4 MLP, SGD with
momentum, gloo, CPU), with DDP's buckets rebuilt as DDP does by default and frozen in their construction layout as
the resume battery keeps them (``harness/resume/buckets.py``; docs/resume.md has the table and the reason). Writes
no result file: the figures are exact (0.0 or the size of one rounding), not timings.
"""

from __future__ import annotations

import argparse
import sys

from _common import ROOT  # noqa: F401  (puts the checkout and tests/support on sys.path)
from support.resume_bodies import rewrap_gap

from harness.distributed.launcher import launch

OPTIONS = {"DDP defaults": {}, "find_unused_parameters=True": {"find_unused_parameters": True},
           "static_graph=True": {"static_graph": True}, "bucket_cap_mb=0.001": {"bucket_cap_mb": 0.001}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worlds", default="2,3,4", help="world sizes, comma-separated")
    args = p.parse_args()
    worlds = [int(w) for w in args.worlds.split(",")]
    print("| W | " + " | ".join(OPTIONS) + " | buckets frozen (the battery) |")
    for world in worlds:
        row = [max(launch(rewrap_gap, world, False, options, deadline=120)) for options in OPTIONS.values()]
        row.append(max(launch(rewrap_gap, world, True, {}, deadline=120)))
        print(f"| {world} | " + " | ".join(f"{g:.3g}" for g in row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
