"""Whether a model keeps the sequences of a packed row apart: the same sequences forwarded unpacked and packed.

Under ``--batch-format packed`` a row holds several sequences back to back, in transformers'
``DataCollatorWithFlattening`` convention: ``input_ids``, ``position_ids`` restarting at 0 for each sequence,
``seq_idx``, and no attention mask. The reference is computed on the same sequences unpacked, so a model is right
under packing only if its attention stays within each sequence and its positions come from ``position_ids``. A model
that attends across the boundaries (a plain causal mask over the whole row; a transformers model with ``use_cache``
on, which then builds no block-diagonal mask) fails parity, and its first step's loss is not the one it would train
on unpacked. :func:`packing_gap` finds that on the model alone, before any rank starts: a few sequences of different
lengths, forwarded once unpacked (one padded row each, with ``attention_mask``, the hf call) and once packed (one row,
no attention mask), and the largest difference of their logits over the real positions.

Nothing here names a recipe: this is a property of the model.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from harness.core.formats import logits_of
from harness.core.microbatch import PAD
from harness.data.config import Config

LENGTHS = (5, 11, 3, 8)
"""The default sequences' lengths: unequal, so that a later sequence starts at a column that is not its position,
and short enough (27 tokens in one row) for any model the battery runs."""

FIX = ("honour position_ids (each sequence's positions restart at 0) and make the attention block-diagonal, a query "
       "seeing only the keys of its own sequence (found from the restarts of position_ids, or from seq_idx); a "
       "transformers model needs use_cache=False (config.use_cache is True by default, in train mode too) and no "
       "attention mask in the packed batch, or it builds no block-diagonal mask (docs/your-model.md)")


@dataclass(frozen=True)
class PackingGap:
    """What :func:`packing_gap` measured: the largest absolute difference of the logits, packed against unpacked,
    over the real positions of sequences of ``lengths`` tokens, and the float tolerance it is judged at."""

    gap: float
    tolerance: float
    lengths: tuple[int, ...]

    @property
    def crosses(self) -> bool:
        """Whether the packed forward's logits are not the unpacked ones (NaN counts as not)."""
        return not self.gap <= self.tolerance

    def note(self) -> str | None:
        """The sentence for the user when the model's attention crosses the boundaries; None otherwise."""
        if not self.crosses:
            return None
        return (f"attention crosses packed sequence boundaries: the packed forward's logits differ from the unpacked "
                f"ones by {self.gap:.1e} (tolerance {self.tolerance:.1e}; sequences of "
                f"{', '.join(map(str, self.lengths))} tokens in one row): {FIX}")


def default_sequences(vocab_size: int = Config().vocab_size, seed: int = 0) -> list[torch.Tensor]:
    """Sequences of :data:`LENGTHS` tokens, ids in ``1 .. vocab_size - 1`` (never ``PAD``), from a private generator."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab_size, (n,), generator=gen) for n in LENGTHS]


def _packed_row(sequences: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
    """One row of ``sequences`` in DataCollatorWithFlattening's convention, the keys the model is called with:
    ``input_ids``, ``position_ids`` restarting at 0 for each sequence, ``seq_idx``; no attention mask (labels are not
    needed to compare logits). Local to this probe: the packed batch format builds the same row for the ranks."""
    return {
        "input_ids": torch.cat(list(sequences)).unsqueeze(0),
        "position_ids": torch.cat([torch.arange(len(s)) for s in sequences]).unsqueeze(0),
        "seq_idx": torch.cat([torch.full((len(s),), i) for i, s in enumerate(sequences)]).unsqueeze(0),
    }


def _takes(model: torch.nn.Module, name: str) -> bool:
    """Whether the model's forward takes the keyword ``name`` (by name, or through ``**kwargs``); True when its
    signature cannot be read (the call itself then tells)."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return True
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _tolerance(reference: torch.Tensor) -> float:
    # A model that keeps the sequences apart computes the same sums packed and unpacked, in another order and over
    # more masked (zero) terms: a few eps of the logits' size. sqrt(eps) of that size is far above such rounding and
    # far below a leak across a boundary, which moves a logit by the attention weight the other sequence's keys take.
    # On the default sequences (docs/your-model.md's table, with the command that printed it; the tests
    # tests/unit/test_packing_probe.py and tests/integrations/test_packing_probe_llama.py assert the bounds): the
    # built-in model 4.2e-7 in float32 and 9.4e-16 in float64, against 5.9e-4 and 2.6e-8; its plain-causal control
    # 1.3; a transformers Llama 0.26 with use_cache on, 4.5e-8 (float32) and 2.8e-17 (float64) with it off.
    eps = torch.finfo(reference.dtype).eps
    return math.sqrt(eps) * max(1.0, float(reference.abs().max()))


def packing_gap(model: torch.nn.Module, sequences: Sequence[torch.Tensor] | None = None, *,
                name: str = "the model") -> PackingGap:
    """Forward ``sequences`` (1-D token ids of different lengths; None: :func:`default_sequences`) unpacked, as one
    right-padded row each with ``attention_mask`` (``model(input_ids=..., attention_mask=...)``), and packed, as one
    row (``model(input_ids=..., position_ids=...)``, with ``seq_idx=`` where the forward takes it, by name or
    ``**kwargs``; no attention mask), without gradients; the largest absolute difference of the logits over the real
    positions. ``model`` as :meth:`harness.battery.spec.ModelSpec.build` gives it (train mode, dropout off).

    A forward that takes no ``position_ids``, or that raises on the packed row, is a
    :class:`harness.model.ModelError` naming ``name`` and the fix: a packed row cannot be forwarded right without
    each token's position in its own sequence."""
    from harness.model import ModelError

    seqs = default_sequences() if sequences is None else [torch.as_tensor(s) for s in sequences]
    if len(seqs) < 2 or any(s.dim() != 1 or len(s) == 0 for s in seqs):
        msg = (f"sequences must be two or more non-empty 1-D tensors of token ids (a packed row holds several), got "
               f"shapes {[tuple(s.shape) for s in seqs]}")
        raise ValueError(msg)
    if not _takes(model, "position_ids"):
        msg = (f"{name}: its forward takes no position_ids, so a packed row (several sequences in one row, each "
               f"with positions restarting at 0) reaches it as one long sequence; add position_ids to its forward "
               f"and {FIX}, or run another batch format")
        raise ModelError(msg)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    lengths = tuple(len(s) for s in seqs)
    longest = max(lengths)
    input_ids = torch.full((len(seqs), longest), PAD, dtype=torch.int64)
    for i, s in enumerate(seqs):
        input_ids[i, : len(s)] = s
    attention_mask = (torch.arange(longest) < torch.tensor(lengths).unsqueeze(1)).long()
    packed = _packed_row(seqs)
    if not _takes(model, "seq_idx"):
        del packed["seq_idx"]
    with torch.no_grad():
        unpacked = logits_of(model(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device)))
        try:
            together = logits_of(model(**{k: v.to(device) for k, v in packed.items()}))
        except Exception as exc:
            text = str(exc).strip().splitlines()
            msg = (f"{name}: model({', '.join(f'{k}=...' for k in packed)}) on one packed row of sequences of "
                   f"{', '.join(map(str, lengths))} tokens failed: {type(exc).__name__}: {text[0] if text else ''}; "
                   f"{FIX}")
            raise ModelError(msg) from exc
    if together.shape[:2] != (1, sum(lengths)):
        msg = (f"{name}: the packed row of {sum(lengths)} tokens gave logits {tuple(together.shape)}, not "
               f"[1, {sum(lengths)}, V]")
        raise ModelError(msg)
    reference = torch.cat([unpacked[i, :n] for i, n in enumerate(lengths)])  # the real positions, in packed order
    gap = float((together[0] - reference).abs().max())  # NaN stays NaN, and crosses
    return PackingGap(gap, _tolerance(reference), lengths)


__all__ = ["FIX", "LENGTHS", "PackingGap", "default_sequences", "packing_gap"]
