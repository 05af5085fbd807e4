"""A warm launch of a battery run over a dp x tp mesh against one over dp alone, at the same world size, both under
FSDP2 through the in-process launcher.

    python benchmarks/tp_launch_bench.py [--repeats 7] [--out benchmarks/results/tp_launch.json]

For each layout (``dp=4`` and ``dp=2,tp=2``, W=4, fp32, ``harness.recipes:mesh_token_mean`` on the ``uneven``
scenario): one launch each to warm the forkserver and the reference chain, then ``--repeats`` launches of each run,
the two layouts alternating (:func:`harness.battery.launch.runner.launch_run`: preparation with the cached chain, the
ranks, their records). Writes the median wall time of each, their ranges, the ratio of the medians and the median of
the ratios of each pair of launches, as JSON, and prints it. The machine is shared and noisy: read the ratios. Not a
test: nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import statistics

from _common import RESULTS, command, machine, now, summary, timed, write_result

from harness.battery import scenarios
from harness.battery.judge import checks
from harness.battery.launch import runner
from harness.battery.plan.options import RunSpec
from harness.core.mesh import Mesh

RECIPE = "harness.recipes:mesh_token_mean"
LAYOUTS = ("dp=4", "dp=2,tp=2")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default=str(RESULTS / "tp_launch.json"))
    args = parser.parse_args()
    result: dict[str, object] = {"command": command("benchmarks/tp_launch_bench.py"), "when": now(),
                                 "machine": machine(), "recipe": RECIPE, "strategy": "fsdp2", "world_size": 4}
    launches = {}
    for label in LAYOUTS:
        mesh = Mesh.parse(label)
        spec = RunSpec(RECIPE, "uneven", mesh.world_size, "fp32", strategy="fsdp2", layout=mesh)
        windows = scenarios.build(spec.scenario, mesh.data_ranks)
        first = runner.launch_run(spec, windows, share_chain=True)
        verdict = checks.parity(first)
        assert verdict.passed, verdict.message  # a launch that fails is not the cost of a run
        launches[label] = lambda spec=spec, windows=windows: runner.launch_run(spec, windows, share_chain=True)
    # The layouts alternate, launch by launch, so that a busy spell of the shared machine falls on both alike.
    times: dict[str, list[float]] = {label: [] for label in LAYOUTS}
    for _ in range(args.repeats):
        for label in LAYOUTS:
            times[label] += timed(launches[label], 1)
    medians = {}
    for label in LAYOUTS:
        result[label] = summary(times[label], 3)
        medians[label] = result[label]["median_s"]  # type: ignore[index]
    result["ratio_tp_over_dp"] = round(medians["dp=2,tp=2"] / medians["dp=4"], 2)
    # Each tp launch over the dp launch just before it: a busy spell that spans a pair cancels out.
    pairs = [tp / dp for dp, tp in zip(times["dp=4"], times["dp=2,tp=2"], strict=True)]
    result["ratio_of_pairs"] = {"median": round(statistics.median(pairs), 2),
                                "range": [round(min(pairs), 2), round(max(pairs), 2)]}
    print(write_result(args.out, result))


if __name__ == "__main__":
    main()
