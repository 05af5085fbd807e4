"""What a diagnosis costs against the parity run it explains.

    python benchmarks/diagnosis_bench.py [--repeat 5] [--out benchmarks/results/diagnosis.json]

For each case (a recipe on a battery scenario at one world size, float32), times ``--repeat`` uncached parity runs
(``harness.battery.launch.runner.run_windows``: the single-device reference chain, then the launch of every rank through
the warm forkserver) and ``--repeat`` diagnoses of the run's worst window (``harness.battery.diagnose.of_run.diagnose``:
one float64 backward per microbatch, the least-squares fit, the per-parameter table; ``--per-sequence`` adds one
backward per row). Writes the medians and their ratio, measured in the same run, as JSON and prints it. The machine
is shared and noisy: read the ratio. Not a test: nothing here asserts a speed.
"""

from __future__ import annotations

import argparse

from _common import RESULTS, command, machine, now, summary, timed, write_result

from harness.battery import scenarios
from harness.battery.diagnose.of_run import diagnose
from harness.battery.launch import runner
from harness.battery.launch.run import Run

CASES = (
    ("harness.recipes:mean_of_local_means", "uneven", 2),
    ("harness.recipes:mean_of_local_means", "uneven", 3),
    ("harness.recipes:per_microbatch_mean", "uneven", 4),
    ("harness.recipes:extra_microbatch_division", "long", 3),
    ("harness.recipes:global_token_mean", "varying", 2),
    ("harness.recipes:global_token_mean", "long", 3),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--per-sequence", action="store_true", help="time the per-sequence fit as well")
    parser.add_argument("--out", default=str(RESULTS / "diagnosis.json"))
    args = parser.parse_args()
    # The first launch starts the forkserver (torch imported once); a warm server is what a battery session has.
    runner.run_windows(CASES[0][0], scenarios.build("uneven", 2))
    rows = []
    for recipe, scenario, world in CASES:
        windows = scenarios.build(scenario, world)
        runs: list[Run] = []

        def launch(recipe: str = recipe, windows: scenarios.Windows = windows, scenario: str = scenario,
                   runs: list[Run] = runs) -> None:
            runs.append(runner.run_windows(recipe, windows, scenario=scenario))

        run_times = timed(launch, args.repeat)
        run = runs[-1]
        found = diagnose(run, per_sequence=args.per_sequence)
        assert found is not None, f"{recipe} on {scenario} left no gradient"
        diag_times = timed(lambda run=run: diagnose(run, per_sequence=args.per_sequence), args.repeat)  # type: ignore[misc]
        r, d = summary(run_times), summary(diag_times)
        rows.append({
            "recipe": recipe, "scenario": scenario, "world_size": world,
            "microbatches": sum(len(mbs) for mbs in windows[found.window]),
            "signature": found.signature.name, "condition": round(found.condition, 3),
            "residual": float(f"{found.residual:.3g}"),
            "max_ratio_error": float(f"{max(abs(q - 1) for q in found.ratios() if q == q):.3g}"),
            "parity_run": r, "diagnosis": d,
            "ratio": round(d["median_s"] / r["median_s"], 3),
        })
        print(f"{recipe.split(':')[-1]:28s} {scenario:8s} W={world}: run {r['median_s']:.3f} s, diagnosis "
              f"{d['median_s']:.3f} s, ratio {rows[-1]['ratio']:.2f} ({found.signature.name})")
    result = {
        "command": command("benchmarks/diagnosis_bench.py"),
        "machine": machine(),
        "date": now(),
        "per_sequence": args.per_sequence,
        "cases": rows,
        "worst_ratio": max(row["ratio"] for row in rows),
        "target": "diagnosis under 3x the parity run it explains",
    }
    write_result(args.out, result)
    print(f"worst ratio {result['worst_ratio']:.2f}; written to {args.out}")


if __name__ == "__main__":
    main()
