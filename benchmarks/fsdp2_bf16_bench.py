"""FSDP2's divisor knobs and the bf16 lane's bound, measured on the battery's own runs (W=2 and 3, the built-in model).

    python benchmarks/fsdp2_bf16_bench.py [--out benchmarks/results/fsdp2_bf16.json]

FSDP2 knobs: the largest error against the reference and each parameter tensor's gradient ratio (got / reference,
median over its components) for the correct recipe under FSDP2's default average, torchtitan's loss with the summing
reduction declared (the harness sets the knobs on every sharded module), the same loss under the average
(``sum_loss_under_averaging``) and with the knobs set on the root module only (``divide_factor_on_root_only``).

bf16: for each strategy and case, the measured noise and the bound derived from it
(:mod:`harness.battery.prepare.bf16`), the correct recipe's error and a mean of local means' error (relative L2 against
float64), their ratios to the bound, and the separation margins (bound / correct error; mistake / bound).

bf16 scale: for each strategy, world size and case, each window's count and its bfloat16 rounding, the correct
computation's own scale noise and the scale bound (DDP; FSDP2 judges no scale), and the largest ``|scale - 1|`` and
relative L2 error of the correct recipe and of a count rounded to bfloat16 (``bfloat16_count``), with their
verdicts. Not a test: nothing here fails on a number.
"""

from __future__ import annotations

import argparse
import sys
import time

from _common import RESULTS, command, machine, now, write_result


def _ratios(run: object) -> dict[str, float]:
    import torch

    r = run  # a harness.battery.launch.run.Run
    model = r.model()  # type: ignore[attr-defined]
    got, ref = r.records[0][0].grad.double(), r.references[0].gradient.double()  # type: ignore[attr-defined]
    out, offset = {}, 0
    for name, p in model.named_parameters():
        n = p.numel()
        g, t = got[offset: offset + n], ref[offset: offset + n]
        keep = t.abs() > 1e-8
        out[name] = round(float(torch.median(g[keep] / t[keep])), 4) if bool(keep.any()) else float("nan")
        offset += n
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(RESULTS / "fsdp2_bf16.json"))
    args = parser.parse_args()
    import torch

    from harness.battery.judge import checks
    from harness.battery.launch import runner
    from harness.battery.plan.options import RunSpec
    from harness.battery.prepare import bf16
    from harness.distributed.launcher import warm

    warm()
    start = time.perf_counter()
    knobs = {}
    for world in (2, 3):
        for label, recipe in (("average, correct recipe", "global_token_mean"),
                              ("sum declared, torchtitan's loss", "summed_global_token_mean"),
                              ("average, torchtitan's loss", "sum_loss_under_averaging"),
                              ("factor on the root only", "divide_factor_on_root_only")):
            run = runner.run(RunSpec(f"harness.recipes:{recipe}", "uneven", world, "fp32", strategy="fsdp2"))
            verdict = checks.parity(run)
            ratios = _ratios(run)
            knobs[f"{label}, W={world}"] = {
                "recipe": recipe, "parity": verdict.status, "max_error": verdict.max_error,
                "ratio_min": min(ratios.values()), "ratio_max": max(ratios.values()), "ratios": ratios}
    lanes = []
    for strategy in ("ddp", "fsdp2"):
        for scenario, world in (("uneven", 2), ("long", 2), ("uneven", 3)):
            good = checks.parity(runner.run(RunSpec("harness.recipes:global_token_mean", scenario, world, "bf16",
                                                    strategy=strategy)))
            bad_run = runner.run(RunSpec("harness.recipes:mean_of_local_means", scenario, world, "bf16",
                                         strategy=strategy))
            bad = checks.parity(bad_run)
            noise = bad_run.bf16
            assert good.max_error is not None and bad.max_error is not None
            lanes.append({
                "strategy": strategy, "scenario": scenario, "world_size": world, "mode": noise.mode,
                "noise": round(noise.noise, 6), "noise_per_seed": [round(x, 6) for x in noise.samples],
                "bound": round(noise.bound, 6), "correct_error": round(good.max_error, 6),
                "correct_ratio": round(good.max_error / noise.bound, 3),
                "mean_of_means_error": round(bad.max_error, 6),
                "mean_of_means_ratio": round(bad.max_error / noise.bound, 2),
                "margin_below": round(noise.bound / good.max_error, 2),
                "margin_above": round(bad.max_error / noise.bound, 2),
                "correct_verdict": good.status, "mean_of_means_verdict": bad.status,
                "mean_of_means_diagnosis": None if bad.diagnosis is None else bad.diagnosis["signature"]})
    scales = []
    for strategy, worlds in (("ddp", (1, 2, 3, 4)), ("fsdp2", (2, 3))):
        for world in worlds:
            for scenario in ("uneven", "long"):
                row: dict[str, object] = {"strategy": strategy, "scenario": scenario, "world_size": world}
                for label, recipe in (("correct", "global_token_mean"), ("bf16_count", "bfloat16_count")):
                    run = runner.run(RunSpec(f"harness.recipes:{recipe}", scenario, world, "bf16", strategy=strategy))
                    verdict = checks.parity(run)
                    read = bf16.read_windows(run, bf16.gradient_function(run.spec, run.objective))
                    row[f"{label}_scale_off"] = round(max(abs(w.scale - 1) for w in read), 7)
                    row[f"{label}_relative_l2"] = round(max(w.error for w in read), 6)
                    row[f"{label}_verdict"] = verdict.status
                counts = [sum(mb.supervised for rank in window for mb in rank) for window in run.windows]
                noise = run.bf16
                row.update({
                    "counts": counts,
                    "counts_bf16": [int(torch.tensor(float(n)).to(torch.bfloat16)) for n in counts],
                    "scale_noise": None if noise.scale is None else round(noise.scale, 7),
                    "scale_noise_per_seed": [round(x, 7) for x in noise.scale_samples],
                    "scale_bound": None if noise.scale_bound is None else round(noise.scale_bound, 7),
                    "relative_l2_bound": round(noise.bound, 6)})
                if noise.scale_bound is not None:
                    row["correct_scale_ratio"] = round(row["correct_scale_off"] / noise.scale_bound, 3)  # type: ignore[operator]
                    row["bf16_count_scale_ratio"] = round(row["bf16_count_scale_off"] / noise.scale_bound, 2)  # type: ignore[operator]
                scales.append(row)
    judged = [x for x in scales if x["scale_bound"] is not None]
    result = {
        "schema": "harness.fsdp2-bf16/1",
        "command": command("benchmarks/fsdp2_bf16_bench.py"),
        "machine": machine(),
        "date": now(),
        "seconds": round(time.perf_counter() - start, 1),
        "fsdp2_knobs": knobs,
        "bf16": lanes,
        "bf16_worst": {"correct_ratio": max(x["correct_ratio"] for x in lanes),
                       "mean_of_means_ratio": min(x["mean_of_means_ratio"] for x in lanes),
                       "margin_below": min(x["margin_below"] for x in lanes),
                       "margin_above": min(x["margin_above"] for x in lanes)},
        "bf16_scale": scales,
        "bf16_scale_worst": {"correct_ratio": max(x["correct_scale_ratio"] for x in judged),  # type: ignore[type-var]
                             "bf16_count_ratio_long": min(x["bf16_count_scale_ratio"] for x in judged  # type: ignore[type-var]
                                                          if x["scenario"] == "long")},
    }
    print(write_result(args.out, result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
