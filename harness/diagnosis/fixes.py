"""What to change in the recipe, in the words of the user's code: every reading and every failing check ends with
its fix.

:func:`fix_for` turns a reading (a signature's name, a :class:`~harness.diagnosis.signatures.Signature`, a diagnosis or
its ``to_dict()``) into its fix from :data:`harness.diagnosis.fix_catalog.FIXES`, written for the run's strategy (DDP's
``no_sync()``, FSDP2's ``set_requires_gradient_sync(False)``), declared objective (the quantity it divides by) and
mesh (the token group ``dp x cp`` a count is reduced over, a pipeline's ``scale_grads``); :func:`check_fix` does the
same for a check's failing verdict that no reading names. ``tests/unit/test_fixes.py`` holds every reading of the
catalog and of the diagnosis modules to a fix, and every form to the words it must use.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from harness.core import objectives as ob
from harness.core.mesh import Mesh
from harness.diagnosis.fix_catalog import CHECK_FIXES, FIXES, NORM_FIXES

TERMS = {
    ob.TOKEN_MEAN: "loss sum",
    ob.SEQUENCE_MEAN: "sum of its sequences' own token means",
    ob.WEIGHTED_TOKEN_MEAN: "weighted loss sum (each supervised token's loss times its weight)",
    ob.FIXED_NORMALIZER: "loss sum",
    ob.LABEL_SMOOTHING: "label-smoothed loss sum ((1 - eps) * nll + eps * the mean of -log p over the whole "
                        "vocabulary, per supervised token)",
    ob.ENTROPY_BONUS: "policy loss sum (-A * log p(y) - beta * the entropy of p, per supervised token)",
}
"""What each objective's numerator is, per microbatch, before the division by ``Z``."""

COUNTS = {
    ob.TOKEN_MEAN: "the window's supervised count",
    ob.SEQUENCE_MEAN: "the window's count of sequences with a supervised token",
    ob.WEIGHTED_TOKEN_MEAN: "the window's weight sum (its supervised tokens' weights)",
    ob.FIXED_NORMALIZER: "the declared normalizer constant",
    ob.LABEL_SMOOTHING: "the window's supervised count",
    ob.ENTROPY_BONUS: "the window's supervised count",
}
"""Each objective's ``Z``, as the recipe's code holds it."""

SKIP = {"ddp": "model.no_sync()", "fsdp2": "model.set_requires_gradient_sync(False)"}
"""How each strategy skips a gradient synchronization (as :data:`harness.battery.rank.rank_program.SKIP_SYNC`)."""

SYNC = {
    "ddp": "run the forward and backward of every microbatch but the last inside model.no_sync() (or with "
           "model.require_backward_grad_sync = False), and the last one's outside it (require_backward_grad_sync = "
           "True), so that the window's last backward, and only it, synchronizes; key it to the window's last "
           "microbatch, not to a step count",
    "fsdp2": "call model.set_requires_gradient_sync(False) before every microbatch but the last, and "
             "model.set_requires_gradient_sync(True) before the last one's backward, so that the window's last "
             "backward, and only it, reduces the gradients; key it to the window's last microbatch, not to a step "
             "count",
}
"""Every microbatch but the last skips the synchronization, in each strategy's words."""

HELPER = " (harness.recipes.sync_context(model, i, n) does this under either strategy)"


@dataclass(frozen=True)
class Forms:
    """The words of one run's strategy, objective and mesh that the fixes' templates are filled with."""

    strategy: str = "ddp"
    objective: str = ob.TOKEN_MEAN
    mesh: Mesh | None = None

    @property
    def multi(self) -> bool:
        """A mesh with a dimension other than dp (its token group is then named by its dimensions: the world size is
        no longer the factor a count's division needs)."""
        return self.mesh is not None and any(self.mesh.size(n) > 1 for n in self.mesh.names if n != "dp")

    @property
    def pipelined(self) -> bool:
        return self.mesh is not None and self.mesh.size("pp") > 1

    @property
    def group(self) -> str:
        if not self.multi:
            return "every data-parallel rank (dist.all_reduce over the default group)"
        assert self.mesh is not None
        dims = [d for d in self.mesh.token_dims if self.mesh.size(d) > 1]
        if not dims:
            return "harness.recipes.token_group(mesh) (a single rank on this mesh)"
        return f"{' x '.join(dims)} (harness.recipes.token_group(mesh))"

    @property
    def size(self) -> str:
        if not self.multi:
            return "the world size (dist.get_world_size())"
        return "the token group's size (harness.recipes.token_group_size(mesh))"

    @property
    def reduced(self) -> str:
        if self.objective == ob.FIXED_NORMALIZER:
            return " (a constant, the same on every rank: nothing to reduce)"
        where = "every data-parallel rank" if not self.multi else f"the token group {self.group}"
        return f", all-reduced over {where}"

    @property
    def right(self) -> str:
        term, count = TERMS.get(self.objective, "loss sum"), COUNTS.get(self.objective, "the objective's normalizer")
        text = f"divide each microbatch's {term} by {count}{self.reduced} before the first backward, times {self.size}"
        if self.objective == ob.SEQUENCE_MEAN and self.mesh is not None and self.mesh.size("cp") > 1:
            # A cp rank holds a chunk of every sequence: a sequence's count is its chunks' sum, and the sequences
            # are counted once, over the data-parallel group (counted over dp x cp, one shows once per chunk).
            text = ("divide each chunk's tokens of a sequence by the sequence's supervised count all-reduced over "
                    "the cp group (mesh[\"cp\"]), and each microbatch's sum of those means by the window's count of "
                    "sequences with a supervised token, all-reduced over the data-parallel group "
                    "(harness.recipes.data_group(mesh)) so that each sequence counts once, before the first "
                    f"backward, times {self.size}")
        if self.pipelined:
            text += ", with scale_grads=False on the pipeline schedule (one normalization, the loss's own)"
        return text

    @property
    def sync(self) -> str:
        return SYNC.get(self.strategy, SYNC["ddp"]) + HELPER

    @property
    def data(self) -> str:
        if self.mesh is not None and self.mesh.size("cp") > 1:
            return ("k the microbatches of harness.recipes.data_group(mesh), not the token group's: the cp ranks of a "
                    "data coordinate hold the same value")
        return "the gradients' average over the ranks does the rest"

    def fill(self, template: str, found: str = "") -> str:
        return template.format(right=self.right, term=TERMS.get(self.objective, "loss sum"),
                               count=COUNTS.get(self.objective, "the objective's normalizer"), reduced=self.reduced,
                               group=self.group, size=self.size, skip=SKIP.get(self.strategy, SKIP["ddp"]),
                               sync=self.sync, found=found, data=self.data,
                               objective=self.objective.replace("_", " "))


def forms(strategy: str = "ddp", objective: str = ob.TOKEN_MEAN, mesh: Mesh | str | None = None) -> Forms:
    """The :class:`Forms` of a strategy, an objective's name and a mesh (a :class:`Mesh` or its label)."""
    return Forms(strategy, objective, Mesh.parse(mesh) if isinstance(mesh, str) else mesh)


def _reading(reading: object) -> dict[str, object]:
    """A reading's name and what its fix names, from a name, a Signature, a diagnosis or a diagnosis' dict."""
    if isinstance(reading, str):
        return {"signature": reading}
    if isinstance(reading, Mapping):
        return dict(reading)
    sig: Any = getattr(reading, "signature", reading)
    out: dict[str, object] = {"signature": sig.name, "factor": sig.factor, "blocks_named": list(sig.blocks),
                              "sentence": sig.sentence, "objective_computed": sig.objective}
    blocks = getattr(reading, "blocks", None)
    if blocks is not None:
        out["weights"] = [{"rank": b.rank, "microbatch": b.microbatch} for b in blocks]
    return out


def _microbatches(read: Mapping[str, object]) -> int | None:
    """The window's microbatch count ``k`` where every rank holds the same (None: unknown or unequal)."""
    rows = read.get("weights")
    if not isinstance(rows, list) or not rows:
        return None
    per: dict[object, set[object]] = {}
    for row in rows:
        per.setdefault(row["rank"], set()).add(row["microbatch"])
    ks = {len(m) for m in per.values()}
    return ks.pop() if len(ks) == 1 else None


def _scale(read: Mapping[str, object], world: int | None) -> str:
    """``global_scale``'s finding: the factor on every weight, named (W, k, 2, ...) where it is one of them."""
    c = read.get("factor")
    if not isinstance(c, (int, float)) or not math.isfinite(c) or c <= 0:
        return "undo the scale on every weight"
    k = _microbatches(read)
    named = str(read.get("sentence") or "").split(";")[0]
    for value, words in ((1 / world if world else 0, f"multiply by the world size W={world}, which is missing"),
                         (world or 0, f"drop the second factor W={world} (a SUM reduction of the gradients where DDP "
                                      "averages, or a loss multiplied by W twice)"),
                         (1 / k if k else 0, f"drop the extra division by the microbatch count k={k} (the window's "
                                             "count already covers every microbatch)"),
                         (k or 0, f"divide by the window's count, which covers its k={k} microbatches"),
                         (2, "backpropagate each microbatch once, or drop the factor 2")):
        if value and value != 1 and abs(c / value - 1) <= 1e-3:
            return f"every weight is {c:.4g}x the right one: {words}"
    return f"every weight is {c:.4g}x the right one ({named}): undo that factor"


def _found(name: str, read: Mapping[str, object], f: Forms, world: int | None) -> str:
    """The part of a fix that names what its reading found."""
    blocks = [str(b) for b in read.get("blocks_named") or []]  # type: ignore[attr-defined]
    listed = ", ".join(blocks[:4]) + (" and more" if len(blocks) > 4 else "")
    if name == "global_scale":
        return _scale(read, world)
    if name in ("dropped", "double_counted", "block_scaled"):
        return f" ({listed})" if blocks else ""
    if name == "extra_term":
        return f" (carried by {listed})" if blocks else ""
    if name == "fixed_accumulation_constant":
        k = _microbatches(read)
        return f" k={k}" if k else " k"
    if name == "per_sequence_mean" and f.objective != ob.SEQUENCE_MEAN:
        return "; or judge it with --objective=sequence_mean where a mean per sequence is the objective meant"
    if name == "other_objective":
        alt = str(read.get("objective_computed") or "")
        if alt not in ob.QUANTITIES:
            return f"{f.right}, the declared objective's normalization"
        return (f"judge it with --objective={alt} where {ob.DESCRIPTIONS[alt]} is the objective meant; else "
                f"{f.right}, not by {ob.QUANTITIES[alt]}")
    return ""


def fix_for(reading: object, *, strategy: str = "ddp", objective: str = ob.TOKEN_MEAN,
            mesh: Mesh | str | None = None, world_size: int | None = None) -> str:
    """What to change in the recipe for ``reading`` (a reading's name, a Signature, a diagnosis or its dict), in the
    words of ``strategy`` (``"ddp"``, ``"fsdp2"``), the declared ``objective`` and ``mesh`` (None: ``dp=W``);
    ``world_size`` names a world-size factor (default: the token group's size of ``mesh``, or the diagnosis's).

    A reading without a fix raises KeyError: ``tests/unit/test_fixes.py`` holds every reading to one."""
    read = _reading(reading)
    name = str(read["signature"])
    f = forms(strategy, objective, mesh)
    world = world_size or (f.mesh.token_ranks if f.mesh is not None else None) or _ranks(read)
    if name not in FIXES:
        msg = f"reading {name!r} has no fix in harness.diagnosis.fix_catalog.FIXES: add one"
        raise KeyError(msg)
    return f.fill(FIXES[name], _found(name, read, f, world))


def _ranks(read: Mapping[str, object]) -> int | None:
    rows = read.get("weights")
    if not isinstance(rows, list) or not rows:
        return None
    return len({row["rank"] for row in rows})


def check_fix(check: str, *, finding: str | None = None, strategy: str = "ddp", objective: str = ob.TOKEN_MEAN,
              mesh: Mesh | str | None = None) -> str:
    """What to change in the recipe for a failing verdict of ``check`` that no diagnosis reads (its ``finding``: a
    named norm of the clipping check, a precision finding of parity), in the run's words."""
    f = forms(strategy, objective, mesh)
    if check == "clipping" and finding in NORM_FIXES:
        return f.fill(NORM_FIXES[finding])
    if finding in CHECK_FIXES:
        return f.fill(CHECK_FIXES[finding])
    if finding in FIXES:
        return f.fill(FIXES[finding])
    if check == "one_sync" and f.pipelined:
        return f.fill(CHECK_FIXES["one_sync_pipeline"])
    if check not in CHECK_FIXES:
        msg = f"check {check!r} has no fix in harness.diagnosis.fix_catalog.CHECK_FIXES: add one"
        raise KeyError(msg)
    return f.fill(CHECK_FIXES[check])


def fix_table() -> str:
    """The catalog's readings and their fixes under DDP, the token mean and ``dp=W``, as the Markdown table
    docs/diagnosis.md shows (``tests/unit/test_fixes.py`` holds the page to it)."""
    lines = ["| reading | fix (ddp, token_mean, dp=W) |", "| --- | --- |"]
    for name in FIXES:
        lines.append(f"| `{name}` | {fix_for(name).replace('|', '/')} |")
    return "\n".join(lines)


__all__ = ["COUNTS", "SKIP", "SYNC", "TERMS", "Forms", "check_fix", "fix_for", "fix_table", "forms"]
