"""A transformers mixture-of-experts model's router auxiliary loss, measured (docs/libraries.md, "transformers MoE
models"): the router-loss recipe, ``Trainer``'s own loop and the same loop with the router term divided by k, on the
tiny Mixtral and Qwen2-MoE (``harness.recipes.libraries.transformers_moe``), parity on the uneven scenario at W=2 and
W=3, and the Mixtral's ``aux_loss`` at initialization and under uniform routing.

    python benchmarks/transformers_moe.py [--out benchmarks/results/transformers_moe.json]

Writes, per (recipe, model, W), the parity verdict, its max error and the diagnosis (signature, line), and the
versions; prints one line per case. Needs the integrations extra (transformers); exit 2 without it.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MODULE = "harness.recipes.libraries.transformers_moe"
RECIPES = {"transformers_moe_router_loss": f"{MODULE}:transformers_moe_router_loss",
           "transformers_moe_trainer_router_loss": f"{MODULE}:transformers_moe_trainer_router_loss",
           "trainer_router_loss_per_microbatch": "harness.recipes:trainer_router_loss_per_microbatch"}
MODELS = {"tiny_mixtral": f"{MODULE}:tiny_mixtral", "tiny_qwen2_moe": f"{MODULE}:tiny_qwen2_moe"}


def aux_values() -> dict[str, float]:
    """The Mixtral's ``aux_loss`` on the uneven scenario's first microbatch at initialization, and with every router
    weight zero (uniform routing)."""
    import torch

    from harness.battery import scenarios
    from harness.battery.spec import ModelSpec
    from harness.core.formats import to_hf

    model = ModelSpec(MODELS["tiny_mixtral"], "hf").build()
    batch = to_hf(scenarios.build("uneven", 2)[0][0][0])

    def aux() -> float:
        with torch.no_grad():
            out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                        output_router_logits=True)
        return float(out.aux_loss)

    at_init = aux()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.zero_()
    return {"at_init": at_init, "uniform": aux()}


def _cell(case: dict[str, Any]) -> str:
    if case["status"] == "pass":
        return f"pass, {case['max_error']:.1e}"
    factor = re.search(r"weighs (\S+)x the right weight", str(case["line"]))
    return f"FAIL {case['max_error']:.1e}" + (f", {factor.group(1)}x" if factor else "")


def markdown(result: dict[str, Any]) -> str:
    """The table docs/libraries.md quotes: one row per recipe, one column per (model, W), each cell the parity
    verdict, its max abs error and, failing, the router term's weight over the right one."""
    cases = result["cases"]
    columns = [(m, w) for m in MODELS for w in (2, 3)]
    label = {"tiny_mixtral": "Mixtral", "tiny_qwen2_moe": "Qwen2-MoE"}
    head = ["recipe", *(f"{label[m]} W={w}" for m, w in columns)]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for name in RECIPES:
        by = {(c["model"], c["world_size"]): c for c in cases if c["recipe"] == name}
        shown = f"`{name}`" + (" (Trainer as shipped)" if name == "trainer_router_loss_per_microbatch" else "")
        lines.append("| " + " | ".join([shown, *(_cell(by[col]) for col in columns)]) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "transformers_moe.json")
    args = parser.parse_args(argv)
    try:
        import transformers
    except ImportError:
        print("needs transformers: pip install .[integrations]", file=sys.stderr)
        return 2
    import torch

    import harness.battery.judge.checks  # noqa: F401  (the checks register themselves)
    from harness.battery.judge import registry
    from harness.battery.launch import runner

    cases = []
    for name, recipe in RECIPES.items():
        for model_name, model in MODELS.items():
            for world in (2, 3):
                run = runner.run(recipe, "uneven", world, model=model, batch_format="hf")
                v = registry.CHECKS["parity"](run)
                diagnosis = v.diagnosis or {}
                cases.append({"recipe": name, "model": model_name, "world_size": world, "status": v.status,
                              "max_error": v.max_error, "signature": diagnosis.get("signature"),
                              "line": diagnosis.get("line")})
                print(f"{name} on {model_name}, W={world}: parity {v.status}, max abs error {v.max_error:.3e}"
                      + (f"; {diagnosis['line']}" if diagnosis else ""))
    aux = aux_values()
    print(f"tiny_mixtral aux_loss: {aux['at_init']:.4f} at initialization, {aux['uniform']:.4f} under uniform routing")
    result = {"versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                           "python": platform.python_version()}, "scenario": "uneven", "cases": cases, "aux_loss": aux}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
