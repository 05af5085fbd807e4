"""What the battery feeds a model, in one place, and the probe's reading of a model that does not take it.

A model written for its own data stops on the battery's in a few known ways: a vocabulary under the battery's (an
embedding that raises ``IndexError`` on the largest ids), a block size under the battery's longest row (a position
table, or nanoGPT's ``assert t <= self.config.block_size``), a forward that returns only the last position's logits
when called without targets (nanoGPT's ``logits[:, [-1], :]``), or a loss inside the model with another ignore index
than the battery's -100 (torch's "Target -100 is out of bounds"). :func:`read_failure` tells the first two apart by
running the model again on ids of 1 and on shorter rows (whatever the text of its error), :func:`check_logits` reads
the output's shape, and :func:`label_loss_note` calls a forward that takes labels or targets with the battery's.
Every reading is one line with the numbers and the fix; :func:`feeds` is what ``docs/your-model.md`` states (a unit
test holds the page to it).
"""

from __future__ import annotations

import inspect
import re
from typing import Any

import torch
from torch import nn

from harness.battery import scenarios
from harness.battery.spec import ModelSpec
from harness.core.formats import HARNESS, HF, PACKED, to_hf
from harness.core.microbatch import IGNORE_INDEX, PAD, Microbatch

VOCAB = scenarios.BATTERY_CONFIG.vocab_size
"""The battery's vocabulary: token ids ``1 .. VOCAB - 1``, id 0 is ``PAD`` (``harness.data.config.Config``)."""

LONGEST_SEQUENCE = scenarios.BATTERY_CONFIG.max_len
"""The longest sequence the battery builds, in tokens: the hf format's ``T + 1``."""

LONGEST_INPUT = LONGEST_SEQUENCE - 1
"""The longest row under ``--batch-format harness``: a sequence of n tokens feeds n - 1 positions."""

PACKED_WIDTH = 2 * LONGEST_SEQUENCE
"""The widest packed row: :func:`harness.core.formats.to_packed` packs into rows of twice the longest sequence."""

def feeds() -> dict[str, int]:
    """The numbers of ``docs/your-model.md``'s "What the battery feeds your model", by the name its table gives them
    (a unit test holds the page to them, with the drawn layouts' two from :mod:`harness.battery.layouts`, a module
    above this one)."""
    return {
        "vocab_size": VOCAB,
        "largest_token_id": VOCAB - 1,
        "pad_id": PAD,
        "ignore_index": IGNORE_INDEX,
        "corpus_min_len": scenarios.BATTERY_CONFIG.min_len,
        "corpus_min_len_large_world": scenarios.corpus_config(scenarios.SMALL_WORLD + 1).min_len,
        "small_world": scenarios.SMALL_WORLD,
        "longest_sequence": LONGEST_SEQUENCE,
        "harness_max_positions": LONGEST_INPUT,
        "hf_max_positions": LONGEST_SEQUENCE,
        "packed_max_width": PACKED_WIDTH,
        "largest_position_id": LONGEST_SEQUENCE - 1,
        "prompt_max": scenarios.BATTERY_CONFIG.prompt_max,
    }


def who(path: str | None) -> str:
    return f"model={path!r}" if path is not None else "the built-in model"


def _error(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def _forward_error(spec: ModelSpec, model: nn.Module, mb: Microbatch) -> str | None:
    """None when the model's forward takes ``mb`` in ``spec``'s format, else its error in one line (the forward only:
    a logits width under the vocabulary is :func:`check_logits`'s)."""
    try:  # gradients on, as everywhere in the probe: a reentrant checkpoint warns without them
        spec.logits(model, mb)
    except Exception as exc:
        return _error(exc)
    return None


def _ids(mb: Microbatch, token: int) -> Microbatch:
    """``mb``'s shape and supervision with every token id ``token``."""
    return Microbatch(torch.full_like(mb.inputs, token),
                      torch.where(mb.labels == IGNORE_INDEX, mb.labels, torch.full_like(mb.labels, token)))


def _largest(runs: Any, lo: int, hi: int) -> int:
    """The largest n in [lo, hi) with ``runs(n)``, given ``runs(lo)`` and not ``runs(hi)`` (monotone)."""
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if runs(mid):
            lo = mid
        else:
            hi = mid
    return lo


def limit_fix(batch_format: str, limit: int) -> str:
    """The row the battery feeds past a model that runs ``limit`` positions, and the fix, in one sentence."""
    need = LONGEST_INPUT if batch_format == HARNESS else LONGEST_SEQUENCE
    rows = (f"the battery's rows reach {LONGEST_INPUT} positions under --batch-format harness (sequences of "
            f"{LONGEST_SEQUENCE} tokens)" if batch_format == HARNESS else
            f"the battery's rows reach {LONGEST_SEQUENCE} tokens under --batch-format {batch_format}")
    if batch_format == PACKED:
        rows += f" (packed rows up to {PACKED_WIDTH} wide, position_ids up to {LONGEST_SEQUENCE - 1})"
    return (f"the model runs rows of at most {limit} positions and {rows}; build it with block_size "
            f"(max_position_embeddings) >= {need}")


def read_failure(spec: ModelSpec, model: nn.Module, mb: Microbatch, exc: BaseException) -> str:
    """The one-line reading of the model's failure on ``mb``: its vocabulary when the same shape of ids 1 runs, its
    row length when shorter rows run, else what the call was and the model's raw error."""
    seen = _error(exc)
    rows, positions = mb.inputs.shape
    call = "model(input_ids=..., attention_mask=...)" if spec.batch_format in (HF, PACKED) else "model(inputs)"
    where = (f"{call} on one battery microbatch ({rows} rows x {positions} positions, batch format "
             f"{spec.batch_format!r})")
    if isinstance(exc, TypeError) and str(exc).startswith("the model returned"):  # logits_of: no logits to read
        return f"{who(spec.path)}: {where} {str(exc).removeprefix('the model ')}"
    if _forward_error(spec, model, _ids(mb, 1)) is None:
        takes = _largest(lambda k: _forward_error(spec, model, _ids(mb, k)) is None, 1, VOCAB - 1) + 1
        return (f"{who(spec.path)}: its forward fails on the battery's token ids ({seen}); it runs ids below {takes}, "
                f"the battery feeds ids 1..{VOCAB - 1} of a vocabulary of {VOCAB} (0 is PAD; "
                "harness.battery.scenarios.BATTERY_CONFIG.vocab_size): build it with vocab_size >= "
                f"{VOCAB}")
    ones = _ids(mb, 1)  # a vocabulary under the battery's as well must not hide the row length
    if positions > 1 and _forward_error(spec, model, Microbatch(ones.inputs[:, :1], ones.labels[:, :1])) is None:
        lo = _largest(lambda t: _forward_error(spec, model, Microbatch(ones.inputs[:, :t], ones.labels[:, :t])) is None,
                      1, positions)
        extra = 0 if spec.batch_format == HARNESS else 1  # hf and packed rows hold one token more than the inputs
        return f"{who(spec.path)}: {seen}; {limit_fix(spec.batch_format, lo + extra)}"
    return (f"{who(spec.path)}: {where} failed with {type(exc).__name__}: {exc}; it fails on ids of 1 and on rows "
            f"of one position too, so it is neither the vocabulary ({VOCAB}) nor the row length. The model must take "
            "token ids [B, T] and return logits [B, T, V] as a tensor, an object with .logits, or a tuple whose first "
            "element is the logits")


def check_logits(spec: ModelSpec, model: nn.Module, mb: Microbatch) -> str | None:
    """None when the model's logits for ``mb`` cover every position and the vocabulary, else the one-line reading."""
    raw, _ = spec.logits(model, mb)
    rows, positions = mb.inputs.shape
    t = positions if spec.batch_format == HARNESS else positions + 1
    got = 1 if raw.dim() == 2 else (raw.shape[1] if raw.dim() == 3 else None)
    if raw.dim() not in (2, 3) or raw.shape[0] != rows:
        return (f"{who(spec.path)}: returns logits of shape {tuple(raw.shape)} for {rows} rows of {t} positions: the "
                f"battery calls the model and reads every position's logits [B, T, V] = [{rows}, {t}, >= {VOCAB}]")
    if got != t:
        return (f"{who(spec.path)}: returns logits for {got} of {t} positions (shape {tuple(raw.shape)}): the battery "
                "calls model(inputs) and reads every position's logits [B, T, V]; make forward return them all when "
                "called without targets (nanoGPT: `logits = self.lm_head(x)` in both branches), or, to keep your model "
                "file as it is, have the --model factory return a subclass whose forward passes targets (nanoGPT: "
                "`super().forward(idx, torch.full_like(idx, -1))`)")
    if raw.shape[-1] < VOCAB:
        return (f"{who(spec.path)}: its logits have {raw.shape[-1]} entries per position, under the battery's "
                f"vocabulary of {VOCAB} (token ids 1..{VOCAB - 1}; harness.battery.scenarios.BATTERY_CONFIG."
                f"vocab_size): build it with vocab_size >= {VOCAB}")
    return None


_OUT_OF_BOUNDS = re.compile(rf"Target {IGNORE_INDEX} is out of bounds")


def label_loss_note(spec: ModelSpec, model: nn.Module, mb: Microbatch) -> str | None:
    """Where the model's forward takes ``labels`` (Hugging Face) or ``targets`` (nanoGPT) and computes a loss with
    them: the note when that loss cannot take the battery's ignore index (torch's "Target -100 is out of bounds"), else
    None. The battery itself never passes labels; a recipe that does would stop on every rank."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return None
    key = next((k for k in ("labels", "targets") if k in params), None)
    if key is None:
        return None
    try:
        if spec.batch_format == HARNESS:
            model(mb.inputs, **{key: mb.labels})
        else:
            batch = to_hf(mb)
            model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], **{key: batch["labels"]})
    except Exception as exc:  # only the ignore index is read here; any other failure of the labelled call is not
        if _OUT_OF_BOUNDS.search(str(exc)):
            return (f"{who(spec.path)}: its forward's own loss stops on the battery's labels ({_error(exc)}): it "
                    f"ignores another index than {IGNORE_INDEX}, which the battery puts at every unsupervised "
                    f"position; map the ignore index (ignore_index={IGNORE_INDEX}, harness.IGNORE_INDEX) in the "
                    f"model's loss, or compute the loss in the recipe (a recipe that calls model(..., {key}=...) "
                    "stops on every rank)")
    return None


__all__ = ["LONGEST_INPUT", "LONGEST_SEQUENCE", "PACKED_WIDTH", "VOCAB", "check_logits", "feeds", "label_loss_note",
           "limit_fix", "read_failure", "who"]
