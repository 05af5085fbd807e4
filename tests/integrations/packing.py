"""Which transformers settings honour a packed (padding-free) batch: a small ``LlamaForCausalLM`` and
``GPT2LMHeadModel`` built from configs (two layers of width 32, vocabulary 64, dropout 0, nothing downloaded), fed
three sequences of different lengths twice: as one right-padded row per sequence with its attention mask (the
reference), and as the single row ``DataCollatorWithFlattening`` packs them into (``position_ids`` restarting at 0
for each sequence, ``-100`` at each sequence's first label).

A setting *honours* packing when the packed logits, at each sequence's own positions, equal the reference's: the model
then attends within each sequence only. It *crosses* boundaries when they differ by more than rounding: a sequence
then attends to the ones packed before it. The loss is read the same way: the model's own loss with the collator's
``labels`` against the token mean, over every sequence's next-token targets, of the reference's cross-entropy.

Imported as ``integrations.packing`` by ``tests/integrations/test_packing.py`` and by ``benchmarks/packing_table.py``
(which writes ``benchmarks/results/packing.json``); transformers is imported inside the functions, so that importing
this module costs nothing where it is missing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

SEQUENCES = ((5, 6, 7, 8, 9), (10, 11, 12), (13, 14, 15, 16, 17, 18, 19))
"""Three sequences of 5, 3 and 7 tokens (no token is the pad id 0)."""

MODELS = ("llama", "gpt2")
IMPLEMENTATIONS = ("eager", "sdpa", "flex_attention")
USE_CACHE = ("default", False)
"""``default`` passes no ``use_cache`` (the config's, True for both models, in train mode too); False passes it."""
MASKS = ("none", "ones")
"""``none`` passes no attention mask with the packed row; ``ones`` passes an all-ones one (what a collator that
always returns ``attention_mask`` gives)."""

LOGITS_BAR = 1e-10
"""Rounding in float64: packed and reference logits of an honouring setting agree to 1e-16 on a float64 path."""

FLOAT32_BAR = 1e-5
"""Where the path computes a step in float32 the two layouts round differently there (summing 15 keys instead of 7):
the honouring settings measured 1.7e-8 on Llama's eager path (float64) and 6e-8 in float32, the model's float32 loss
5e-7 at most, against 5e-3 and more wherever boundaries are crossed (``benchmarks/results/packing.json``)."""

FLOAT32_STEPS = {("llama", "eager"): "eager_attention_forward's softmax(..., dtype=torch.float32)"}
"""The (model, implementation) paths with a float32 step in their logits, and where it is."""

LOSS_BAR = FLOAT32_BAR
"""The model's loss is always float32: ``ForCausalLMLoss`` upcasts the logits with ``logits.float()``, which turns
float64 logits into float32 ones."""


def build(model: str, implementation: str, dtype: torch.dtype = torch.float64) -> nn.Module:
    """The model, in train mode with every dropout 0, its weights drawn from a generator seeded with 0 (the global
    generator is left as it was)."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    config: Any
    if model == "llama":
        cls: Any = LlamaForCausalLM
        config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                             attention_dropout=0.0, pad_token_id=0)
    elif model == "gpt2":
        cls = GPT2LMHeadModel
        # GPT-2's config defaults its bos/eos ids to 50256, outside a vocabulary of 64: set them inside it.
        config = GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=128, resid_pdrop=0.0,
                            embd_pdrop=0.0, attn_pdrop=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=1)
    else:
        msg = f"model={model!r} is not one of {MODELS}; pass one of them"
        raise ValueError(msg)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        built = cls._from_config(config, attn_implementation=implementation, dtype=dtype)
    return built.train()


def unpacked() -> dict[str, torch.Tensor]:
    """One right-padded row per sequence: ``input_ids`` (pad 0) and ``attention_mask``."""
    width = max(map(len, SEQUENCES))
    ids = torch.zeros(len(SEQUENCES), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, seq in enumerate(SEQUENCES):
        ids[i, :len(seq)] = torch.tensor(seq)
        mask[i, :len(seq)] = 1
    return {"input_ids": ids, "attention_mask": mask}


def packed(flash_kwargs: bool) -> dict[str, Any]:
    """The collator's packed row; with ``flash_kwargs`` also ``cu_seq_lens_q/k``, ``max_length_q/k`` and
    ``seq_idx``."""
    from transformers import DataCollatorWithFlattening

    collator = DataCollatorWithFlattening(return_tensors="pt", return_flash_attn_kwargs=flash_kwargs,
                                          return_seq_idx=flash_kwargs)
    return dict(collator([{"input_ids": list(seq)} for seq in SEQUENCES]))


def _reference_loss(logits: torch.Tensor) -> torch.Tensor:
    """The token mean, over every sequence's next-token targets, of the reference logits' cross-entropy."""
    total, count = logits.new_zeros(()), 0
    for i, seq in enumerate(SEQUENCES):
        targets = torch.tensor(seq[1:])
        total = total + F.cross_entropy(logits[i, :len(seq) - 1], targets, reduction="sum")
        count += len(seq) - 1
    return total / count


def _packed_rows(logits: torch.Tensor) -> torch.Tensor:
    """The packed row's logits laid out as the reference's (zeros at the padded positions)."""
    out = logits.new_zeros(len(SEQUENCES), max(map(len, SEQUENCES)), logits.shape[-1])
    start = 0
    for i, seq in enumerate(SEQUENCES):
        out[i, :len(seq)] = logits[0, start:start + len(seq)]
        start += len(seq)
    return out


def _real(rows: torch.Tensor) -> torch.Tensor:
    """The logits at each sequence's real positions, concatenated."""
    return torch.cat([rows[i, :len(seq)] for i, seq in enumerate(SEQUENCES)])


@dataclass(frozen=True, slots=True)
class Reading:
    """One setting's measurement."""

    model: str
    attn_implementation: str
    dtype: str
    use_cache: str | bool
    """``"default"`` (the config's, True) or False."""
    mask: str
    flash_kwargs: bool
    logits_error: float | None
    """Max abs difference of the packed logits from the reference's, at the real positions; None when it failed."""
    loss_error: float | None
    """Abs difference of the model's packed loss from the reference token mean; None when it failed."""
    bar: float
    """The logits error under which the setting honours packing (:data:`LOGITS_BAR`, or :data:`FLOAT32_BAR` on a path
    with a float32 step)."""
    error: str | None = None
    """The first line of the exception the model raised, when it did."""

    @property
    def honours(self) -> bool | None:
        """True when both the logits and the loss match the reference; None when the setting failed to run."""
        if self.logits_error is None or self.loss_error is None:
            return None
        return self.logits_error < self.bar and self.loss_error < LOSS_BAR

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "attn_implementation": self.attn_implementation, "dtype": self.dtype,
                "use_cache": self.use_cache, "mask": self.mask, "flash_kwargs": self.flash_kwargs,
                "logits_error": self.logits_error, "loss_error": self.loss_error, "bar": self.bar,
                "loss_bar": LOSS_BAR, "honours": self.honours, "error": self.error}


def _first_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"


def reference_floor(net: nn.Module) -> float:
    """How far the padded reference is from each sequence run alone (one row, no mask, no padding): the reference's
    own rounding, which every honouring setting must stay near."""
    batch = unpacked()
    with torch.no_grad():
        rows = net(**batch, use_cache=False).logits
        alone = [net(input_ids=torch.tensor([seq]), use_cache=False).logits[0] for seq in SEQUENCES]
    return max(float((rows[i, :len(seq)] - alone[i]).abs().max()) for i, seq in enumerate(SEQUENCES))


def measure(model: str, implementation: str,
            dtype: torch.dtype = torch.float64) -> tuple[list[Reading], float | None]:
    """Every (use_cache, mask, flash kwargs) setting of one model and implementation, and the reference's floor
    (None when the implementation failed). A failure to build or to run is recorded in each reading's ``error``."""
    float32 = dtype != torch.float64 or (model, implementation) in FLOAT32_STEPS
    bar = FLOAT32_BAR if float32 else LOGITS_BAR
    name = str(dtype).removeprefix("torch.")
    settings = [(c, m, f) for c in USE_CACHE for m in MASKS for f in (False, True)]
    try:
        net = build(model, implementation, dtype)
        with torch.no_grad():
            reference = net(**unpacked(), use_cache=False).logits
        floor = reference_floor(net)
    except Exception as exc:  # any failure of the library is the reading
        failed = _first_line(exc)
        return [Reading(model, implementation, name, c, m, f, None, None, bar, failed) for c, m, f in settings], None
    want_loss = _reference_loss(reference)
    readings = []
    for use_cache, mask, flash in settings:
        batch = packed(flash)
        if mask == "ones":
            batch["attention_mask"] = torch.ones_like(batch["input_ids"])
        kwargs: dict[str, Any] = {} if use_cache == "default" else {"use_cache": use_cache}
        try:
            with torch.no_grad():
                out = net(**batch, **kwargs)
        except Exception as exc:
            failed = _first_line(exc)
            readings.append(Reading(model, implementation, name, use_cache, mask, flash, None, None, bar, failed))
            continue
        logits_error = float((_real(_packed_rows(out.logits)) - _real(reference)).abs().max())
        loss_error = float((out.loss.double() - want_loss).abs())
        readings.append(Reading(model, implementation, name, use_cache, mask, flash, logits_error, loss_error, bar))
    return readings, floor
