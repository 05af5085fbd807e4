"""How often the logged-loss check rejects a wrongly weighted logged loss, from the initial weights and from the
warmed weights every run starts from (``harness.battery.prepare.start``).

    python benchmarks/logged_loss_start.py [--layouts 100] [--out benchmarks/results/logged_loss_start.json]

For the built-in model and ``user_recipes.models:small_init_lm`` (initialised as a Hugging Face model is), each
logged-loss recipe of ``tests/user_recipes/logged.py`` runs on the six scenarios with tokens at W=2 and 3 (float32),
judged by ``checks.logged_loss``; then, on ``--layouts`` drawn layouts (derandomized, W in 1-4), the three wrongly
weighted means are computed at each layout's start on one device and counted outside the check's tolerance (atol
1e-6, rtol 1e-4) where the weighting differs from the token mean's (unequal counts). Not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from _common import RESULTS, command, machine, now, write_result

import harness.battery.prepare.start as start
from harness.battery import scenarios
from harness.battery.judge import checks
from harness.battery.launch import runner
from harness.battery.plan.options import RunSpec
from harness.battery.spec import ModelSpec
from harness.core.formats import logits_of

MODELS = (None, "user_recipes.models:small_init_lm")
LOGGED = ("LoggedMeanOfLocalMeans", "LoggedMicrobatchMean", "LoggedSequenceMean", "LoggedGlobalTokenMean")
WRONG = ("mean of the ranks' means", "mean of the microbatches' means", "mean of the sequences' means")


def _scenarios(model: str | None) -> dict[str, int]:
    out = {}
    for name in LOGGED:
        fails = 0
        for scenario in scenarios.BATTERY_SCENARIOS:
            if scenario == "all_empty":
                continue
            for world in (2, 3):
                spec = RunSpec(f"user_recipes.logged:{name}", scenario, world, "fp32", model=model)
                fails += checks.logged_loss(runner.launch_run(spec, scenarios.build(scenario, world))).status == "fail"
        out[name] = fails
    return out


def _wrong_means(model: torch.nn.Module, window: Any) -> tuple[list[bool], list[bool]]:
    """Whether each wrong mean is outside the tolerance, and whether its weighting differs from the token mean's."""
    ranks, micro, rows, total, count = [], [], [], 0.0, 0
    counts: tuple[list[int], list[int], list[int]] = ([], [], [])
    with torch.no_grad():
        for mbs in window:
            s, c = 0.0, 0
            for mb in mbs:
                logits = logits_of(model(mb.inputs))
                per = torch.nn.functional.cross_entropy(logits.flatten(0, 1), mb.labels.flatten(), ignore_index=-100,
                                                        reduction="none").view(mb.labels.shape)
                mask = mb.labels != -100
                if mask.any():
                    micro.append(float(per[mask].mean()))
                    counts[1].append(int(mask.sum()))
                for r in range(per.shape[0]):
                    if mask[r].any():
                        rows.append(float(per[r][mask[r]].mean()))
                        counts[2].append(int(mask[r].sum()))
                s, c = s + float(per[mask].sum()), c + int(mask.sum())
            ranks.append(s / c if c else 0.0)
            counts[0].append(c)
            total, count = total + s, count + c
    mean = total / count
    wrong = (sum(ranks) / len(ranks), sum(micro) / len(micro), sum(rows) / len(rows))
    return [abs(w - mean) > 1e-6 + 1e-4 * abs(mean) for w in wrong], [len(set(c)) > 1 for c in counts]


def _drawn(model: str | None, n: int) -> dict[str, list[int]]:
    from hypothesis import HealthCheck, Phase, given, settings

    from harness.battery.layouts import Layout, layouts

    drawn: list[Layout] = []

    @settings(max_examples=n, derandomize=True, deadline=None, database=None, phases=(Phase.explicit, Phase.generate),
              suppress_health_check=list(HealthCheck))
    @given(layouts())
    def collect(layout: Layout) -> None:
        drawn.append(layout)

    collect()
    caught, differ = [0, 0, 0], [0, 0, 0]
    for layout in drawn:
        with torch.random.fork_rng(devices=[]):
            net = start.starting_model(ModelSpec(model, init_seed=layout.init_seed))
        outside, unequal = _wrong_means(net, layout.build()[0])
        for i in range(3):
            caught[i] += outside[i] and unequal[i]
            differ[i] += unequal[i]
    return {w: [c, d] for w, c, d in zip(WRONG, caught, differ)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", type=int, default=100)
    parser.add_argument("--out", default=str(RESULTS / "logged_loss_start.json"))
    args = parser.parse_args()
    rows = []
    steps = start.WARMUP_STEPS
    for model in MODELS:
        for warmed in (False, True):
            start.WARMUP_STEPS = steps if warmed else 0
            start._start.cache_clear()
            row = {"model": model or "built-in", "start": "warmed" if warmed else "initial",
                   "scenario_failures_of_12": _scenarios(model),
                   "drawn_outside_tolerance_of_unequal": _drawn(model, args.layouts)}
            rows.append(row)
            print(row, flush=True)
    start.WARMUP_STEPS = steps
    result = {"command": command("benchmarks/logged_loss_start.py"), "machine": machine(), "date": now(),
              "warmup": {"steps": steps, "lr": start.WARMUP_LR, "rows": start.WARMUP_ROWS,
                         "positions": start.WARMUP_POSITIONS}, "rows": rows}
    write_result(args.out, result)
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
