"""The battery on a real transformer next to the built-in model, in one run: how much a user's model costs.

    python benchmarks/model_battery_bench.py [--repeats 1] [--examples 2] [--out benchmarks/results/model_battery.json]

Each measurement is ``python -m harness battery --recipe harness.recipes:hf_global_token_mean --batch-format hf
--battery-world-sizes 1,2,3 --precision both --battery-examples N`` in a fresh process (forkserver start and imports
included), from a scratch directory outside the checkout, for three models: the built-in ``TinyCausalLM`` (no
``--model``), a two-layer GPT-2 and a two-layer Llama built from transformers configs (``GPT2LMHeadModel`` /
``LlamaForCausalLM``, width 32, the battery's vocabulary; no weights downloaded). The models are measured in turn,
``--repeats`` times each, so the ratios come from one run on one machine. Two more runs of GPT-2 each turn one of
the battery's savings off (the model classes' modules preloaded into the forkserver; copies of the first built model
in the parent) to show where the time went before them. Needs the integrations extra (transformers). Not a test:
nothing here asserts a speed; read the ratios (``ratio_over_builtin``), not the absolute figures (the machine is
shared).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import RESULTS, ROOT, command, machine, now, write_result

MODELS = '''
"""Two-layer transformers models from configs, shaped like the integrations lane's."""
from torch import nn


def tiny_gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=128, n_embd=32, n_layer=2, n_head=2,
                                      bos_token_id=1, eos_token_id=2))


def tiny_llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                        attention_dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2))
'''

WAYS = {"built-in TinyCausalLM": (None, ""), "GPT-2 (2 layers)": ("bench_models:tiny_gpt2", ""),
        "Llama (2 layers)": ("bench_models:tiny_llama", "")}

# Where the time went before: each way below turns one of the battery's savings off, to show what it saves.
ABLATIONS = {
    "GPT-2, model classes' modules not preloaded (transformers imported in every rank of every launch)": (
        "bench_models:tiny_gpt2",
        "import harness.battery.launch.runner as r, harness.battery.spec as s\n"
        "r.model_modules = lambda p: (s.model_module(p),) if p else ()\n"),
    "GPT-2, every model built by its constructor (no copy of the first)": (
        "bench_models:tiny_gpt2",
        "import harness.battery.spec as s\n"
        "class _Never(dict):\n    def __setitem__(self, k, v): pass\n"
        "s._BUILT = _Never()\n"),
}

_MAIN = "import sys\n{patch}from harness.workflow.cli import main\nsys.exit(main(sys.argv[1:]))\n"


def _measure(model: str | None, examples: int, cwd: Path, patch: str = "") -> tuple[float, str]:
    cmd = [sys.executable, "-c", _MAIN.format(patch=patch), "battery", "--recipe",
           "harness.recipes:hf_global_token_mean", "--batch-format", "hf", "--battery-world-sizes", "1,2,3",
           "--precision", "both", "--battery-examples", str(examples)]
    if model:
        cmd += ["--model", model]
    t0 = time.monotonic()
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=1800,
                          env={**__import__("os").environ, "PYTHONPATH": f"{cwd}:{ROOT}"})
    wall = time.monotonic() - t0
    last = [ln for ln in done.stdout.splitlines() if " checks over " in ln]
    if done.returncode != 0:
        raise SystemExit(f"battery on {model} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return wall, last[0] if last else ""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--examples", type=int, default=2, help="drawn layouts per battery")
    p.add_argument("--out", default=str(RESULTS / "model_battery.json"))
    p.add_argument("--no-ablations", action="store_true", help="skip the runs that turn one saving off")
    args = p.parse_args()
    ways = dict(WAYS) if args.no_ablations else {**WAYS, **ABLATIONS}
    tmp = Path(tempfile.mkdtemp(prefix="model-battery-bench-"))
    try:
        (tmp / "bench_models.py").write_text(MODELS)
        walls: dict[str, list[float]] = {name: [] for name in ways}
        said: dict[str, str] = {}
        for _ in range(args.repeats):
            for name, (model, patch) in ways.items():  # in turn, so that load on the machine spreads over all
                wall, line = _measure(model, args.examples, tmp, patch)
                walls[name].append(wall)
                said[name] = line
                print(f"{name}: {wall:.1f} s ({line})", flush=True)
        base = statistics.median(walls["built-in TinyCausalLM"])
        results = {name: {"model": ways[name][0], "wall_median_s": round(statistics.median(w), 1),
                          "wall_range_s": [round(min(w), 1), round(max(w), 1)], "battery_says": said[name],
                          "ratio_over_builtin": round(statistics.median(w) / base, 2)} for name, w in walls.items()}
        write_result(Path(args.out), {
            "command": command("benchmarks/model_battery_bench.py"),
            "what": "wall time of `python -m harness battery` (hf_global_token_mean, --batch-format hf, W=1-3, both "
                    f"precisions, {args.examples} drawn layouts) per model, each in a fresh process",
            "machine": machine(), "date": now(), "repeats": args.repeats, "results": results,
        })
        for name, r in results.items():
            print(f"{name}: median {r['wall_median_s']} s, {r['ratio_over_builtin']}x the built-in model")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
