"""Recipes for real libraries: transformers' Trainer driven through its inner loop, accelerate's gradient accumulation,
torchtitan's loss, each as users write it and corrected, and :data:`LIBRARY_RECIPES`, the verdicts the battery must
give each one and the signature the gradient diagnosis (:mod:`harness.battery.diagnose.of_run`) must read off each
failing gradient (the integrations tests assert both; ``benchmarks/library_table.py`` measures them for the README).

Any of them runs through the battery like a user's recipe, e.g.
``python -m harness battery --recipe harness.recipes.libraries.transformers_loss:transformers_global_items``.
The modules import without their libraries (``setup()`` then raises naming the install); nothing here imports one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import metadata

TESTED_WITH = {"torch": "2.13.0", "transformers": "5.25.0", "accelerate": "1.15.0", "torchtitan": "0.3.0"}
"""The versions the expected verdicts were measured with."""

CASES: dict[str, tuple[str, str, int, str]] = {
    "parity": ("parity", "uneven", 2, "fp32"),
    "parity fp64": ("parity", "uneven", 2, "fp64"),
    "parity single": ("parity", "single", 2, "fp32"),
    "one_sync": ("one_sync", "uneven", 2, "fp32"),
    "one_sync single": ("one_sync", "single", 2, "fp32"),
    "logged_loss": ("logged_loss", "uneven", 2, "fp32"),
    "hygiene": ("hygiene", "uneven", 2, "fp32"),
    "empty_window": ("empty_window", "all_empty", 2, "fp32"),
    "parity bf16": ("parity", "uneven", 2, "bf16"),
}
"""Column name -> (check, scenario, world size, precision): the cases that tell these libraries apart. ``uneven``:
one window of two microbatches per rank with different counts per rank; ``single``: one microbatch per rank (a short
final window); ``all_empty``: no supervised token anywhere; ``parity bf16``: the bf16 lane (autocast under DDP, the
mixed-precision policy under FSDP2) against its derived bound."""


@dataclass(frozen=True)
class Expect:
    """The verdict a case must give: ``"pass"`` or ``"fail"``, why, the finding a failure must carry if any, and the
    signature the gradient diagnosis must give the case's run (required on a failing parity case: its verdict carries
    the diagnosis; on another failing case the run is diagnosed directly)."""

    status: str
    why: str
    finding: str | None = None
    diagnosis: str | None = None
    note: str | None = None
    """Text a note of the verdict must hold (a pass that carries a consequence, as a NaN logged loss on an empty
    window does)."""


PASS = Expect("pass", "right")
FLOAT32_LOSS = Expect("fail", "the library computes the loss in float32 (logits.float()): the float64 lane fails at "
                      "float32 rounding scale", "float32_computation", diagnosis="float32_computation")
NAN_ON_EMPTY = Expect("pass", "no supervised token anywhere: the loss is 0/0 = NaN, returned without an error; the "
                      "gradients are zero (cross-entropy gives ignored positions none): the zero-gradient policy, "
                      "with a note that the optimizer still steps unless the loop skips it",
                      note="unless the loop skips optimizer.step() when the window's global count is 0")


@dataclass(frozen=True)
class LibraryRecipe:
    """One library configuration: its recipe, the library it exercises, and the verdict per column of :data:`CASES`."""

    path: str
    library: str
    configuration: str
    """How a user configures the library to get this behaviour (the README table's first column)."""
    fix: str
    """What to change when it fails (empty for the corrected configurations)."""
    expected: dict[str, Expect] = field(default_factory=dict)
    strategy: str = "ddp"
    """The data-parallel strategy the configuration runs under (``"fsdp2"``: the harness shards the model)."""

    @property
    def name(self) -> str:
        return self.path.split(":")[-1]

    def expect(self, column: str) -> Expect:
        return self.expected.get(column, PASS)


_T = "harness.recipes.libraries.transformers_loss"
_A = "harness.recipes.libraries.accelerate_accumulation"
_TT = "harness.recipes.libraries.torchtitan_loss"

LIBRARY_RECIPES: tuple[LibraryRecipe, ...] = (
    LibraryRecipe(
        f"{_T}:transformers_global_items", "transformers",
        "`Trainer`'s inner loop (`get_batch_samples`, `training_step` under `no_sync` but the last), "
        "`average_tokens_across_devices=True` (the default): gathered `num_items_in_batch`, loss x W",
        "skip the step when the gathered `num_items_in_batch` is 0; judge it with `--precision fp32`",
        {"parity fp64": FLOAT32_LOSS, "empty_window": NAN_ON_EMPTY},
    ),
    LibraryRecipe(
        f"{_T}:transformers_local_items", "transformers",
        "the same `Trainer` loop, `average_tokens_across_devices=False`: this rank's `num_items_in_batch`",
        "set `average_tokens_across_devices=True`",
        {
            "parity": Expect("fail", "a mean of local means: each rank divides by its own count, DDP averages",
                             diagnosis="mean_of_local_means"),
            "parity bf16": Expect("fail", "a mean of local means, seen through bf16 noise",
                                  diagnosis="mean_of_local_means"),
            "parity fp64": Expect("fail", "a mean of local means (and float32 computation)",
                                  diagnosis="mean_of_local_means"),
            "parity single": Expect("fail", "a mean of local means", diagnosis="mean_of_local_means"),
            "logged_loss": Expect("fail", "the logged loss is the mean over ranks of local means"),
            "empty_window": NAN_ON_EMPTY,
        },
    ),
    LibraryRecipe(
        f"{_A}:accelerate_naive", "accelerate",
        "`Accelerator(gradient_accumulation_steps=2, cpu=True)`, `with accumulate(model)`: mean loss, "
        "`accelerator.backward`",
        "normalize the loss sum by the global count x `num_processes` x `gradient_accumulation_steps` (backward "
        "divides by it); set `gradient_accumulation_steps` to the window's length and `step` to 0 before each "
        "window (or `no_sync(model)` around all but the window's last microbatch instead of `accumulate`); stop "
        "on a zero global count",
        {
            "parity": Expect("fail", "a mean of per-microbatch means, divided by gradient_accumulation_steps",
                             diagnosis="per_microbatch_mean"),
            "parity bf16": Expect("fail", "a mean of per-microbatch means, seen through bf16 noise",
                                  diagnosis="per_microbatch_mean"),
            "parity fp64": Expect("fail", "a mean of per-microbatch means", diagnosis="per_microbatch_mean"),
            # Each rank's gradient holds its own microbatch only, at its local mean halved by backward (see the
            # module): read as not synchronized, with the own block's weight named.
            "parity single": Expect("fail", "accumulate's counter never reached 2: no synchronization, each rank "
                                    "kept its own gradient (its local mean / gradient_accumulation_steps)",
                                    diagnosis="not_synchronized"),
            "one_sync single": Expect("fail", "accumulate syncs by its own step counter: a one-microbatch window "
                                      "never synchronizes", diagnosis="not_synchronized"),
            "logged_loss": Expect("fail", "accelerator.reduce(mean of microbatch means) is a mean of means"),
            "empty_window": NAN_ON_EMPTY,
        },
    ),
    LibraryRecipe(
        f"{_A}:accelerate_corrected", "accelerate",
        "the same `accumulate` loop: loss sum x `num_processes` x `gradient_accumulation_steps` / global count, "
        "`gradient_accumulation_steps = len(window)` and `step = 0` before each window",
        "",
    ),
    LibraryRecipe(
        f"{_TT}:torchtitan_loss", "torchtitan",
        "`CrossEntropyLoss` with `global_valid_tokens` (sum / global count), a backward per microbatch, under DDP",
        "multiply the loss by the data-parallel world size (DDP averages; torchtitan's FSDP2 sums); `no_sync()` "
        "around all but the last microbatch; stop when `global_valid_tokens` is 0",
        {
            "parity": Expect("fail", "the world-size factor is missing: right under a summing reduction, DDP "
                             "averages", diagnosis="global_scale"),
            "parity fp64": Expect("fail", "the world-size factor is missing", diagnosis="global_scale"),
            "parity single": Expect("fail", "the world-size factor is missing", diagnosis="global_scale"),
            "parity bf16": Expect("fail", "the world-size factor is missing", diagnosis="global_scale"),
            "one_sync": Expect("fail", "no gradient-sync suppression: DDP synchronizes after every microbatch (a "
                               "cost, not a wrong gradient)"),
            "empty_window": NAN_ON_EMPTY,
        },
    ),
    LibraryRecipe(
        f"{_TT}:torchtitan_loss_fsdp2", "torchtitan",
        "the same loss (sum / global count, a backward per microbatch) under FSDP2 with the summing reduction it is "
        "written for (`reduction = \"sum\"` declared: the divisor knobs on every sharded module)",
        "`set_requires_gradient_sync(False)` on all but the last microbatch; stop when `global_valid_tokens` is 0",
        {
            "parity fp64": FLOAT32_LOSS,
            "one_sync": Expect("fail", "every microbatch reduce-scatters (a cost, not a wrong gradient)"),
            "empty_window": NAN_ON_EMPTY,
        },
        strategy="fsdp2",
    ),
    LibraryRecipe(
        f"{_TT}:torchtitan_loss_corrected", "torchtitan",
        "the same loss x W, `no_sync()` but the last, a zero-count guard",
        "judge it with `--precision fp32`",
        {"parity fp64": FLOAT32_LOSS},
    ),
)
"""Every library configuration and the verdicts the battery must give it (columns of :data:`CASES`; unlisted: pass),
with the diagnosis of each failing gradient (measured with ``benchmarks/library_table.py``: the mean of local means
for the Trainer's local count, a mean per microbatch for accelerate's loop, the missing world-size factor for
torchtitan under DDP, float32 computation where only the float64 lane fails)."""


NOT_ROWS: dict[str, str] = {
    "accelerate fsdp2": "no row: accelerate 1.15 with `Accelerator(cpu=True, fsdp_plugin="
                        "FullyShardedDataParallelPlugin(fsdp_version=2))` under a process group prepares a "
                        "DistributedDataParallel model (distributed type MULTI_CPU): its FSDP2 path is not taken on "
                        "the CPU, so there is no FSDP2 behaviour of its own to check here",
    "trl": "no row: TRL's preference and RL losses are trainer methods, not functions. GRPO's loss types (grpo: a mean "
           "per sequence, then over sequences; bnpo and dapo: a token mean over the local or the accumulated global "
           "batch; dr_grpo: a sum over batch size x max_completion_length) live in GRPOTrainer._compute_loss(self, "
           "model, inputs), which reads the trainer's loss_type, max_completion_length, beta, temperature, "
           "accelerator and metrics, and DPO's in DPOTrainer's methods; none can be called without building the "
           "trainer (a model, a tokenizer, a dataset, reward functions), and trl is not installed here (the "
           "integrations extra does not list it). The same normalizations are the battery's own policy-gradient "
           "recipes, each checked under its objective: harness.recipes.objectives:pg_sequence_mean (grpo), "
           "pg_token_mean (dapo; bnpo where the batch is the window), pg_fixed_normalizer (dr_grpo)",
}
"""Libraries asked about that have no row, and why (``benchmarks/library_table.py`` writes them beside the rows)."""


def installed_version(library: str) -> str | None:
    """The installed version of a distribution, without importing it (None: not installed)."""
    try:
        return metadata.version(library)
    except metadata.PackageNotFoundError:
        return None


__all__ = ["CASES", "LIBRARY_RECIPES", "NOT_ROWS", "TESTED_WITH", "Expect", "LibraryRecipe", "installed_version"]
