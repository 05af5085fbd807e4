"""Which transformers settings honour a packed batch (``DataCollatorWithFlattening``): docs/libraries.md's "Packed
batches" table, measured on the installed transformers by ``integrations.packing`` (``tests/integrations/packing.py``).

    bash scripts/integrations.sh --co -q     # installs transformers (torch held), collects only
    python benchmarks/packing_table.py [--out benchmarks/results/packing.json]

One row per (model, attn_implementation, dtype, use_cache, attention mask, flash kwargs): the max abs error of the
packed logits and of the model's loss against the padded reference, the bar, whether the setting honours packing
(None where it failed, with the exception's first line) and, where it crosses boundaries, the setting to change (read
off the honouring rows of the same model and implementation). Every implementation runs in float64; flex_attention
runs in float32 too, since its CPU kernel refuses float64 (about 90 s of compiling). Prints the markdown table.
Exit 2 when transformers is missing.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from _common import RESULTS, machine, now, write_result

KEY = ("model", "attn_implementation", "dtype", "flash_kwargs")
"""The rows among which a crossing row looks for the honouring setting it should change to."""


def fix(row: dict[str, Any], rows: list[dict[str, Any]]) -> str | None:
    """What to change in a crossing row's setting so that it honours packing, from the honouring rows of the same
    model, implementation, dtype and flash kwargs; None for an honouring or failed row, or when none honours."""
    if row["honours"] is not False:
        return None
    changes = []
    for other in rows:
        if other["honours"] and all(other[k] == row[k] for k in KEY):
            change = []
            if other["use_cache"] != row["use_cache"]:
                change.append(f"pass use_cache={other['use_cache']}")
            if other["mask"] != row["mask"]:
                change.append("drop the attention mask" if other["mask"] == "none" else "pass an all-ones mask")
            changes.append(" and ".join(change))
    return " or ".join(changes) or None


def measure() -> dict[str, Any]:
    import importlib.metadata

    import torch
    from integrations import packing

    try:
        transformers = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        print("packing_table: transformers is not installed: run bash scripts/integrations.sh --co -q first",
              file=sys.stderr)
        raise SystemExit(2) from None
    start = time.monotonic()
    rows: list[dict[str, Any]] = []
    floors = {}
    for model in packing.MODELS:
        for implementation in packing.IMPLEMENTATIONS:
            dtypes = (torch.float64, torch.float32) if implementation == "flex_attention" else (torch.float64,)
            for dtype in dtypes:
                readings, floor = packing.measure(model, implementation, dtype)
                floors[f"{model} {implementation} {str(dtype).removeprefix('torch.')}"] = floor
                rows.extend(r.to_dict() for r in readings)
                print(f"{model} {implementation} {dtype}: {time.monotonic() - start:.0f} s", file=sys.stderr,
                      flush=True)
    for row in rows:
        row["fix"] = fix(row, rows)
    return {
        "schema": "harness.packing-table/1",
        "command": "python benchmarks/packing_table.py",
        "versions": {"torch": torch.__version__, "transformers": transformers},
        "machine": machine(),
        "date": now(),
        "sequences": [len(s) for s in packing.SEQUENCES],
        "bars": {"logits": packing.LOGITS_BAR, "float32": packing.FLOAT32_BAR, "loss": packing.LOSS_BAR,
                 "float32_steps": {f"{m} {i}": where for (m, i), where in packing.FLOAT32_STEPS.items()}},
        "reference_floor": floors,
        "seconds": round(time.monotonic() - start, 1),
        "rows": rows,
    }


def _first_sentence(text: str) -> str:
    cut = text.find(". ")
    return text if cut < 0 else text[:cut + 1]


def _error(value: float | None) -> str:
    return "-" if value is None else f"{value:.1e}"


def markdown(result: dict[str, Any]) -> str:
    """The table: one line per (model, implementation, dtype, use_cache, mask), the flash kwargs' rows folded into
    one column (``same`` where they measured the same errors), and one line per setting that failed to run."""
    head = ["model", "attn_implementation", "dtype", "use_cache", "attention mask", "logits error", "loss error",
            "with flash kwargs", "packing", "what to change"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    rows = result["rows"]
    failed: set[tuple[str, str, str]] = set()
    for row in rows:
        if row["flash_kwargs"]:
            continue
        where = (row["model"], row["attn_implementation"], row["dtype"])
        if row["error"] is not None:
            if where not in failed:
                failed.add(where)
                lines.append("| " + " | ".join([*where, "any", "any", "-", "-", "-",
                                                f"fails: {_first_sentence(row['error'])}", "-"]) + " |")
            continue
        twin = next(r for r in rows if r["flash_kwargs"] and all(
            r[k] == row[k] for k in ("model", "attn_implementation", "dtype", "use_cache", "mask")))
        same = (twin["logits_error"], twin["loss_error"]) == (row["logits_error"], row["loss_error"])
        flash = "same" if same else f"{_error(twin['logits_error'])}, {_error(twin['loss_error'])}"
        use_cache = "default (True)" if row["use_cache"] == "default" else str(row["use_cache"])
        verdict = "honours" if row["honours"] else "crosses boundaries"
        lines.append("| " + " | ".join([*where, use_cache, row["mask"], _error(row["logits_error"]),
                                        _error(row["loss_error"]), flash, verdict, row["fix"] or "-"]) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(RESULTS / "packing.json"))
    args = parser.parse_args()
    result = measure()
    write_result(args.out, result)
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
