"""What a device mesh costs: one battery run over a mesh against the same run over ``dp=W`` at the same world size,
through the same in-process launcher, under each strategy.

    python benchmarks/mesh_bench.py [--repeats 3] [--out benchmarks/results/mesh.json]

Each pair runs the correct recipe on the ``uneven`` scenario in float32 at W=4 and judges parity:
``dp=2,cp=2`` against ``dp=4`` under DDP and under FSDP2, ``dp_replicate=2,dp_shard=2`` (HSDP) against ``dp=4``
under FSDP2 (``harness.recipes:mesh_token_mean``), and the pipeline ``dp=2,pp=2`` (GPipe,
``harness.recipes:pipeline_token_mean``) against ``dp=4`` under DDP and FSDP2 stages, and under DDP stages with
``interleaved1f1b`` (two stages per rank) and with 1F1B over 2 schedule steps per window; and the mixture-of-experts
model (``--model harness.moe:moe``) over ``dp=2,ep=2`` under DDP and ``dp_shard=2,ep=2`` under FSDP2 against the
dense model over ``dp=4`` (the expert-parallel dispatch, its collectives and the expert groups' own reduction
included). The forkserver is started and
every case run once before any figure (warm); each timed repeat starts from a cleared run cache and reference chain
cache (preparation and launch both timed), and the repeats of a pair
alternate so that the shared machine's drift falls on both. Writes the medians and each pair's ratio (mesh / 1-D) as
JSON and prints them. Not a test: nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from _common import RESULTS, command, machine, now, write_result

RECIPE = "harness.recipes:mesh_token_mean"
PIPELINE = "harness.recipes:pipeline_token_mean"
MOE = "harness.moe:moe"
PAIRS = (("ddp", "dp=2,cp=2", "gpipe", 1, None), ("fsdp2", "dp=2,cp=2", "gpipe", 1, None),
         ("fsdp2", "dp_replicate=2,dp_shard=2", "gpipe", 1, None), ("ddp", "dp=2,pp=2", "gpipe", 1, None),
         ("fsdp2", "dp=2,pp=2", "gpipe", 1, None), ("ddp", "dp=2,pp=2", "interleaved1f1b", 1, None),
         ("ddp", "dp=2,pp=2", "1f1b", 2, None), ("ddp", "dp=2,ep=2", "gpipe", 1, MOE),
         ("fsdp2", "dp_shard=2,ep=2", "gpipe", 1, MOE))
"""(strategy, mesh, pp schedule, pp steps, model) cases, each measured against the built-in dense model over ``dp=4``
under the same strategy."""

TARGETS = {"mesh": 1.5, "pp": 2.0, "moe": 2.0}
"""The most a case may cost over its 1-D pair: a mesh case 1.5x, a pipeline case 2x, a mixture-of-experts case over
ep 2x."""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(RESULTS / "mesh.json"))
    args = parser.parse_args()
    from harness.battery.judge import checks
    from harness.battery.launch import runner
    from harness.battery.plan.options import RunSpec
    from harness.battery.prepare import steps as prepare
    from harness.core.mesh import Mesh

    def once(strategy: str, shape: str | None, schedule: str = "gpipe", steps: int = 1,
             model: str | None = None) -> float:
        """One parity run from cold caches: the preparation, the launch and the check."""
        layout = None if shape is None else Mesh.parse(shape)
        runner._CACHE.clear()
        prepare._CHAINS.clear()
        t = time.perf_counter()
        recipe = PIPELINE if layout is not None and layout.size("pp") > 1 else RECIPE
        verdict = checks.parity(runner.run(RunSpec(recipe, "uneven", 4, "fp32", strategy=strategy, layout=layout,
                                                   pp_schedule=schedule, pp_steps=steps, model=model)))
        took = time.perf_counter() - t
        assert verdict.passed, verdict.message
        return took

    cases = list(dict.fromkeys([*PAIRS, *((s, None, "gpipe", 1, None) for s, *_ in PAIRS)]))
    for c in cases:  # warm: the forkserver, its preloads, the model's probe
        once(*c)
    times: dict[tuple[str, str | None, str, int, str | None], list[float]] = {c: [] for c in cases}
    for _ in range(args.repeats):
        for c in cases:
            times[c].append(once(*c))
    results = []
    for pair in PAIRS:
        strategy, shape, schedule, steps, model = pair
        flat_case = (strategy, None, "gpipe", 1, None)
        mesh, flat = statistics.median(times[pair]), statistics.median(times[flat_case])
        pp = "pp=" in shape
        kind = "moe" if model else "pp" if pp else "mesh"
        results.append({"strategy": strategy, "mesh": shape, "one_d": "dp=4", **({"model": model} if model else {}),
                        **({"pp_schedule": schedule, "pp_steps": steps} if pp else {}),
                        "mesh_s": {"median": round(mesh, 3), "runs": [round(x, 3) for x in times[pair]]},
                        "one_d_s": {"median": round(flat, 3), "runs": [round(x, 3) for x in times[flat_case]]},
                        "ratio": round(mesh / flat, 2), "target": TARGETS[kind]})
        label = f"{shape} {schedule} A={steps}" if pp else f"{shape} moe" if model else shape
        print(f"{strategy:5} {label:34} {mesh:.3f} s vs dp=4 {flat:.3f} s: {mesh / flat:.2f}x", flush=True)
    result = {
        "schema": "harness.mesh-bench/1",
        "command": command("benchmarks/mesh_bench.py"),
        "what": "wall time of one parity run (preparation from cold caches, launch, check) of "
                f"{RECIPE} ({PIPELINE} over pp) on scenario uneven, fp32, W=4, in-process launcher, warm; median of "
                f"{args.repeats}",
        "machine": machine(),
        "date": now(),
        "repeats": args.repeats,
        "target": "a mesh case costs at most 1.5x the 1-D case at the same world size, a pipeline case 2x, a "
                  "mixture-of-experts case over ep 2x the dense model over dp=4",
        "results": results,
        "worst_ratio": max(r["ratio"] for r in results),  # type: ignore[type-var]
        "over_target": [r["mesh"] for r in results if r["ratio"] > r["target"]],  # type: ignore[operator]
    }
    print(write_result(args.out, result)[-200:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
