"""The report's figure: supervised tokens per rank in each window, and the loss curves of the continuous and resumed
runs, one PNG.

matplotlib is imported inside the function with the Agg backend: the figure is written on headless machines (CI, the
GPU runner) and importing ``harness`` must not need a display or even matplotlib. The PNG is drawn in memory and
written through a fsynced temporary name, so an existing figure is replaced whole or not at all.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path

from harness.resume.checkpoint import write_atomic


def write_figure(
    path: str | Path,
    tokens_per_window: Sequence[Sequence[int]],
    continuous_losses: Sequence[float],
    resumed_losses: Sequence[float],
    stop_at: int,
) -> Path:
    """Write the two panels to ``path`` (PNG, whatever its suffix); returns ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    steps = range(1, len(tokens_per_window) + 1)
    world = len(tokens_per_window[0]) if tokens_per_window else 0
    for rank in range(world):
        left.plot(steps, [w[rank] for w in tokens_per_window], marker=".", linewidth=1, label=f"rank {rank}")
    left.set_title("Supervised tokens per rank in each window")
    left.set_xlabel("optimizer step (window)")
    left.set_ylabel("supervised tokens")
    left.legend()

    right.plot(range(1, len(continuous_losses) + 1), continuous_losses, label="continuous", linewidth=2)
    # The resumed run's history holds the stopped run's first steps (restored from the checkpoint): draw only the
    # steps it computed itself, so the overlap with the continuous curve is the evidence.
    after = list(resumed_losses)[stop_at:]
    right.plot(range(stop_at + 1, stop_at + 1 + len(after)), after, linestyle="--", linewidth=2,
               label=f"resumed from step {stop_at}")
    right.axvline(stop_at, color="grey", linewidth=0.8)
    right.set_title("Training loss (global token mean)")
    right.set_xlabel("optimizer step")
    right.set_ylabel("loss")
    right.legend()

    fig.tight_layout()
    buf = io.BytesIO()
    try:
        fig.savefig(buf, format="png", dpi=100)
    finally:
        plt.close(fig)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, buf.getvalue())
    return out
