"""A small causal language model: ``model(inputs) -> logits [B, T, V]`` in the parameters' dtype; and the loader of
a user's model (``--model=pkg.mod:factory``) with the battery's dropout rule.

Small on purpose (18,944 parameters at the battery's size: the components every parity message counts;
``tests/unit/test_model.py`` counts them) so that a whole warm launch of a 2-rank DDP step on CPU takes 0.078 s
(median, ``benchmarks/results/launch.json``) and the suite measures the protocol, not the matrix multiplications.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from harness.core.formats import shifted_loss_sum
from harness.core.microbatch import IGNORE_INDEX, PAD
from harness.core.paths import resolve
from harness.data.config import Config


class CausalLMOutput(NamedTuple):
    """What a keyword call (``model(input_ids=...)``) returns, shaped like a Hugging Face output: ``.logits``, and
    ``.loss`` when ``labels`` were passed (HF's default: the shifted *mean* over supervised tokens of this call)."""

    logits: torch.Tensor
    loss: torch.Tensor | None = None


# Sequence sharding under context parallelism (harness.distributed.sequence_sharding): a cp rank holds a chunk of
# every sequence, and its attention gathers the other chunks' keys and values. The attention masks by the positions
# themselves (a query attends to every key at or before its own position, wherever that key's rank holds it), so
# either chunking, contiguous or load-balanced, gives the full sequence's attention. ``assume_contiguous`` is the
# mistake of an attention written for contiguous chunks only (a ring attention without the load-balanced layout): it
# masks by the ranks' order instead.

FAR = 2**40
"""The position given to padding keys: after every real query, so the causal mask hides them."""


class _Gathered(torch.autograd.Function):
    """Every rank's tensor of ``group``, stacked in rank order; the gradient of each part goes back to its owner,
    summed over the ranks that used it (an all-reduce, then this rank's part)."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group, ctx.rank = group, dist.get_rank(group)
        return torch.stack(_plain_gather(t, group))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.rank], None


def _gather(t: torch.Tensor, group: Any) -> list[torch.Tensor]:
    """Every cp rank's ``t`` (equal shapes), in rank order; differentiable (the gradient flows back to each owner)."""
    return list(_Gathered.apply(t.contiguous(), group).unbind(0))


def _plain_gather(t: torch.Tensor, group: Any) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t.contiguous(), group=group)
    return out


def gathered_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, group: Any,
                       assume_contiguous: bool = False) -> torch.Tensor:
    """Causal attention of this rank's queries ``q`` ``[B, H, t, D]`` over every cp rank's keys and values, each
    rank's ``positions`` ``[B, t]`` its columns' places in the full sequence. Returns ``[B, H, t, D]``."""
    n = dist.get_world_size(group)
    me = dist.get_rank(group)
    length = torch.tensor([k.shape[2]], dtype=torch.int64)
    lengths = _plain_gather(length, group)
    longest = int(max(int(x) for x in lengths))
    pad = longest - k.shape[2]
    if pad:
        k = torch.nn.functional.pad(k, (0, 0, 0, pad))
        v = torch.nn.functional.pad(v, (0, 0, 0, pad))
    where = torch.nn.functional.pad(positions, (0, pad), value=FAR) if pad else positions
    keys = torch.cat(_gather(k, group), dim=2)
    values = torch.cat(_gather(v, group), dim=2)
    key_pos = torch.cat(_plain_gather(where, group), dim=1)  # [B, n * longest]
    if assume_contiguous:
        # Ranks in order hold consecutive chunks: every key of an earlier rank is visible, of a later one not, and a
        # rank's own keys causally by their local order.
        rank_of = torch.arange(n).repeat_interleave(longest)
        local = torch.arange(longest).repeat(n)
        real = key_pos < FAR
        before = (rank_of < me).view(1, 1, -1) & real.unsqueeze(1)
        own = (rank_of == me).view(1, 1, -1) & (local.view(1, 1, -1) <= torch.arange(q.shape[2]).view(1, -1, 1))
        mask = before | (own & real.unsqueeze(1))
    else:
        mask = key_pos.unsqueeze(1) <= positions.unsqueeze(2)  # [B, t, n * longest]
    att = (q @ keys.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    att = att.masked_fill(~mask.unsqueeze(1), float("-inf")).softmax(dim=-1)
    return att @ values


def packed_segments(position_ids: torch.Tensor) -> torch.Tensor:
    """Which sequence of a packed row each column belongs to, from its positions ``[B, T]``: a new sequence starts
    wherever a position does not exceed the one before it (transformers' ``DataCollatorWithFlattening`` restarts
    ``position_ids`` at 0 for each sequence), the first column in sequence 0. ``0 .. T-1`` is one sequence; so is a
    cp rank's chunk, whose positions increase. Returns int64 ``[B, T]``."""
    starts = torch.zeros_like(position_ids, dtype=torch.int64)
    starts[:, 1:] = (position_ids[:, 1:] <= position_ids[:, :-1]).long()
    return starts.cumsum(dim=1)


def builtin_cp_plan(model: nn.Module, cp_mesh: Any, *, assume_contiguous: bool = False) -> None:
    """Make :class:`harness.model.TinyCausalLM`'s attention gather over ``cp_mesh`` (every block), in place.
    ``assume_contiguous``: the attention of a negative control, written for contiguous chunks only."""
    group = cp_mesh.get_group()
    for block in model.blocks:  # type: ignore[union-attr]
        block.cp_group = group
        block.cp_assume_contiguous = assume_contiguous


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int, dropout: float) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))
        self.drop = nn.Dropout(dropout)
        self.cp_group: Any = None
        """The cp group whose ranks hold the other chunks of the sequence (a sequence-sharding run:
        :mod:`harness.distributed.sequence_sharding`); None: this rank holds whole sequences."""
        self.cp_assume_contiguous = False

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None,
                segments: torch.Tensor | None = None) -> torch.Tensor:
        """``segments`` ``[B, T]``: the sequence each column belongs to in a packed row (None: one sequence per row);
        a query then attends to the keys at or before it *of its own sequence* only. Ignored under a cp group, whose
        attention masks by ``positions`` across ranks."""
        # The shapes come from qkv's output, not from x: under sequence parallelism x holds this tp rank's
        # positions only, and the qkv projection gathers them (harness.distributed.tensor_parallel).
        qkv = self.qkv(self.ln1(x))
        b, t, d = qkv.shape[0], qkv.shape[1], qkv.shape[2] // 3
        h = self.n_heads
        q, k, v = qkv.split(d, dim=2)
        q, k, v = (z.view(b, t, h, d // h).transpose(1, 2) for z in (q, k, v))
        if self.cp_group is not None:  # this rank's chunk; the others' keys gathered
            if positions is None:
                msg = ("this model shards the sequence over cp (its cp_plan) and got no position_ids: a cp rank "
                       "holds a chunk of each sequence, so pass its positions, model(mb.inputs, "
                       "position_ids=mb.positions)")
                raise RuntimeError(msg)
            y = gathered_attention(q, k, v, positions, self.cp_group, self.cp_assume_contiguous)
            x = x + self.drop(self.proj(y.transpose(1, 2).reshape(b, t, d)))
            return x + self.drop(self.mlp(self.ln2(x)))
        # Explicit causal attention rather than scaled_dot_product_attention: the same kernel on every torch
        # version and device, and deterministic, which bit-exact resume relies on.
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // h)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        if segments is not None:
            # Block-diagonal: several sequences packed in one row must not see each other. Every query keeps its own
            # key, so no row of the softmax is all -inf; where a row holds one sequence the mask is the causal one,
            # element for element, and so are the logits, bit for bit.
            mask = (mask & (segments.unsqueeze(2) == segments.unsqueeze(1))).unsqueeze(1)  # [B, 1, T, T]
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (self.drop(att) @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.drop(self.proj(y))
        return x + self.drop(self.mlp(self.ln2(x)))


class TinyCausalLM(nn.Module):
    """Token and position embeddings, ``n_layers`` pre-norm transformer blocks, a linear head."""

    def __init__(
        self,
        vocab_size: int,
        max_len: int,
        d_model: int = 32,
        n_layers: int = 1,
        n_heads: int = 2,
        dropout: float = 0.0,
        activation_checkpointing: bool = False,
    ) -> None:
        super().__init__()
        self.max_len = max_len
        self.activation_checkpointing = activation_checkpointing
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(max_len, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, dropout) for _ in range(n_layers))
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size)
        self.block_diagonal = True
        """Whether attention keeps to each sequence of a packed row (the sequences found from ``position_ids`` or
        ``seq_idx``); False is the negative control :func:`crosses_packed_boundaries`, causal over the whole row."""
        self.seq_multiple = 1
        """The forward pads the sequence on the right to a multiple of this, and drops the padding's logits: under
        sequence parallelism (:mod:`harness.distributed.tensor_parallel` sets it to the tp size) every tp rank must
        hold as many positions as the others. Causal attention keeps the padding out of every real position."""

    def forward(
        self,
        inputs: torch.Tensor | None = None,
        *,
        position_ids: torch.Tensor | None = None,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        seq_idx: torch.Tensor | None = None,
    ) -> Any:
        """``model(inputs)`` -> logits ``[B, T, V]``; ``model(input_ids=..., attention_mask=..., labels=None)`` (a
        Hugging Face style call) -> :class:`CausalLMOutput`.

        ``attention_mask`` is accepted and not needed: the harness pads on the right, and under causal attention a
        padding position never reaches the logits of a real one. ``labels`` (unshifted, HF's convention) make
        ``.loss`` HF's shifted mean. ``position_ids`` ``[B, T]``: each column's position in its full sequence, where
        the inputs hold a part of it (a cp rank's chunk, :mod:`harness.distributed.sequence_sharding`), or in its own
        sequence where a row packs several (transformers' ``DataCollatorWithFlattening``: the positions restart at 0
        for each sequence); None: ``0 .. T-1``.

        Packed rows: attention is causal and block-diagonal, each sequence seeing only itself. The sequences come from
        ``seq_idx`` ``[B, T]`` (equal ids, one sequence) when it is given, else from the restarts of ``position_ids``
        (:func:`packed_segments`): ``seq_idx`` wins when both are given, and ``position_ids`` then only place the
        position embedding. Neither given, or one sequence per row (``position_ids`` ``0 .. T-1``): plain causal
        attention, bit for bit. No ``attention_mask`` is needed. Under context parallelism (a block's cp group) the
        attention masks by the positions across ranks and a packed row is not supported.
        """
        if (inputs is None) == (input_ids is None):
            msg = "pass the token ids once: model(inputs) or model(input_ids=...)"
            raise TypeError(msg)
        if inputs is not None:
            return self._logits(inputs, position_ids, seq_idx)
        assert input_ids is not None
        if attention_mask is not None and attention_mask.shape != input_ids.shape:
            msg = (f"attention_mask {tuple(attention_mask.shape)} must have the shape of input_ids "
                   f"{tuple(input_ids.shape)}")
            raise ValueError(msg)
        logits = self._logits(input_ids, position_ids, seq_idx)
        if labels is None:
            return CausalLMOutput(logits)
        count = (labels[:, 1:] != IGNORE_INDEX).sum()
        return CausalLMOutput(logits, shifted_loss_sum(logits, labels) / count)

    def _logits(self, inputs: torch.Tensor, position_ids: torch.Tensor | None = None,
                seq_idx: torch.Tensor | None = None) -> torch.Tensor:
        # With position_ids (packed rows) a row may be longer than max_len: its positions may not.
        if inputs.dim() != 2 or (inputs.shape[1] > self.max_len if position_ids is None
                                 else position_ids.numel() and int(position_ids.max()) >= self.max_len):
            msg = f"inputs must be [B, T] with positions below max_len={self.max_len}, got shape {tuple(inputs.shape)}"
            raise ValueError(msg)
        if position_ids is not None and position_ids.shape != inputs.shape:
            msg = f"position_ids {tuple(position_ids.shape)} must have the shape of the inputs {tuple(inputs.shape)}"
            raise ValueError(msg)
        if seq_idx is not None and seq_idx.shape != inputs.shape:
            msg = (f"seq_idx {tuple(seq_idx.shape)} must have the shape of the inputs {tuple(inputs.shape)}: the "
                   "sequence each column of a packed row belongs to")
            raise ValueError(msg)
        if seq_idx is not None and any(b.cp_group is not None for b in self.blocks):
            msg = ("seq_idx (packed rows) was given to a model that shards the sequence over cp (its cp_plan): its "
                   "attention masks by positions across the cp ranks and does not keep packed sequences apart; "
                   "run packed batches without cp")
            raise ValueError(msg)
        t = inputs.shape[1]
        if t % self.seq_multiple:
            extra = self.seq_multiple - t % self.seq_multiple
            inputs = F.pad(inputs, (0, extra), value=PAD)
            if position_ids is not None:  # the padding after every real position, so causal attention hides it
                position_ids = F.pad(position_ids, (0, extra), value=self.max_len - 1)
            if seq_idx is not None:  # a sequence of its own: the real positions never see it, causal or not
                seq_idx = F.pad(seq_idx, (0, extra), value=-1)
        segments = None
        if self.block_diagonal:
            segments = seq_idx if seq_idx is not None else (
                None if position_ids is None else packed_segments(position_ids))
        if position_ids is None:
            x = self.drop(self.tok(inputs) + self.pos(torch.arange(inputs.shape[1], device=inputs.device)))
        else:
            x = self.drop(self.tok(inputs) + self.pos(position_ids))
        for block in self.blocks:
            if self.activation_checkpointing and self.training:
                # Keep only each block's input; recompute its inside during backward.
                x = checkpoint(block, x, position_ids, segments, use_reentrant=False)
            else:
                x = block(x, position_ids, segments)
        logits = self.head(self.ln(x))
        return logits if logits.shape[1] == t else logits[:, :t]


def build_model(
    config: Config, *, dropout: float | None = None, seed: int | None = None, activation_checkpointing: bool = False
) -> TinyCausalLM:
    """The model of ``config`` with initial weights drawn from ``seed`` (default ``config.seed``).

    The weights come from a private generator, so building a model never touches the global RNG state.
    """
    # nn.Linear and nn.Embedding draw their default initialization from the global RNG; fork it so that building a
    # model leaves the caller's RNG state exactly as it was (the weights are overwritten below anyway).
    with torch.random.fork_rng(devices=[]):
        model = TinyCausalLM(
            vocab_size=config.vocab_size,
            max_len=config.max_len,
            d_model=config.d_model,
            n_layers=config.n_layers,
            n_heads=config.n_heads,
            dropout=config.dropout if dropout is None else dropout,
            activation_checkpointing=activation_checkpointing,
        )
    init_weights(model, config.seed if seed is None else seed)
    return model.to(config.dtype)


def init_weights(model: nn.Module, seed: int) -> None:
    """The built-in models' initial weights, in place, from a private generator seeded with ``seed``: biases 0,
    layer-norm weights 1, every matrix N(0, 0.1^2) in the order of ``named_parameters``."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif p.dim() == 1:  # layer-norm weights
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)


# --- A user's model ------------------------------------------------------------------------------------------------


class ModelError(ValueError):
    """A ``--model`` that cannot be used: a bad import path, an import error, a factory that raised, or something that
    is not an ``nn.Module`` factory."""


_MODEL_FIX = ("--model wants 'package.module:attr' naming a zero-argument callable that returns a torch.nn.Module, or "
              "an nn.Module class built with no argument (see docs/your-model.md)")


def load_model_factory(path: str) -> Callable[[], nn.Module]:
    """The factory named by ``"package.module:attr"``; :class:`ModelError` naming the value and the fix otherwise."""
    if not isinstance(path, str) or path.count(":") != 1 or not all(path.split(":")):
        msg = f"model={path!r} must look like 'package.module:attr'; {_MODEL_FIX}"
        raise ModelError(msg)
    _, attr = path.split(":")
    obj: Any = resolve(path, "model", _MODEL_FIX, ModelError)
    if isinstance(obj, nn.Module):
        msg = (f"model={path!r} is an nn.Module instance; every rank and the reference build their own copy from the "
               f"same seed, so give the factory that builds it instead; {_MODEL_FIX}")
        raise ModelError(msg)
    if not callable(obj):
        msg = f"model={path!r}: {attr!r} is a {type(obj).__name__}, not callable; {_MODEL_FIX}"
        raise ModelError(msg)
    return obj


def build_user_model(path: str, seed: int) -> nn.Module:
    """Call the factory of ``path`` right after ``torch.manual_seed(seed)``, so that every process that builds it
    (each rank, the reference) draws the same initial weights; the caller's global RNG state is left as it was."""
    factory = load_model_factory(path)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            model = factory()
        except Exception as exc:
            msg = f"model={path!r}: calling it to build the model failed: {type(exc).__name__}: {exc}; {_MODEL_FIX}"
            raise ModelError(msg) from exc
    if not isinstance(model, nn.Module):
        msg = f"model={path!r} returned a {type(model).__name__}, not a torch.nn.Module; {_MODEL_FIX}"
        raise ModelError(msg)
    return model


DROPOUT_SUFFIXES = ("dropout", "_pdrop")
"""A float attribute whose name ends so (of ``model.config``, or of any submodule) is a dropout probability."""


def disable_dropout(model: nn.Module) -> nn.Module:
    """The battery's dropout rule, applied after building (a model is built before the harness can reach its
    configuration): every dropout module's ``p`` is set to 0; where the model has a ``config`` object, each float
    attribute whose name ends in ``dropout`` or ``_pdrop`` is set to 0.0; so is each such float attribute of a
    submodule (the probability a functional ``F.dropout`` call reads). The mode is left alone (the battery runs in
    train mode). Returns ``model``.

    A probability the model copied somewhere else at construction (a closure, a constant) is out of reach: build such
    a model with dropout 0 in its factory.
    """
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd):
            module.p = 0.0
        _zero_dropout_floats(module)
    config = getattr(model, "config", None)
    if config is not None and not isinstance(config, nn.Module):
        _zero_dropout_floats(config)
    return model


def _zero_dropout_floats(obj: object) -> None:
    for name, value in list(getattr(obj, "__dict__", {}).items()):
        if isinstance(value, float) and name.endswith(DROPOUT_SUFFIXES):
            setattr(obj, name, 0.0)


def sequence_sharded() -> TinyCausalLM:
    """The built-in model at the battery's size, declared as sharding the sequence under context parallelism
    (``--model harness.model:sequence_sharded``): each cp rank receives only its chunk of every microbatch, and the
    attention gathers the other chunks' keys and values (:mod:`harness.distributed.sequence_sharding`). Its initial
    weights come from the seed the caller set (a ``--model`` factory is called right after ``torch.manual_seed``)."""
    return build_model(Config(dropout=0.0), seed=torch.initial_seed())


sequence_sharded.cp_plan = builtin_cp_plan  # type: ignore[attr-defined]


def crosses_packed_boundaries() -> TinyCausalLM:
    """Negative control for packed batches (``--model harness.model:crosses_packed_boundaries``): the built-in model
    at the battery's size, positions from ``position_ids``, whose attention is causal over the whole packed row and
    ignores where one sequence ends and the next begins, so each sequence after the first sees the tokens of those
    before it. The classic packing mistake: a training loop that packs rows and keeps the model's plain causal mask, or
    a transformers model fed packed rows with ``use_cache`` on or an all-ones attention mask (it then builds no
    block-diagonal mask). One sequence per row (the ``harness`` and ``hf`` formats) is the built-in model, bit for
    bit; under ``packed`` its logits differ from the unpacked reference's."""
    model = build_model(Config(dropout=0.0), seed=torch.initial_seed())
    model.block_diagonal = False
    return model


__all__ = [
    "CausalLMOutput",
    "ModelError",
    "TinyCausalLM",
    "build_model",
    "build_user_model",
    "builtin_cp_plan",
    "crosses_packed_boundaries",
    "disable_dropout",
    "gathered_attention",
    "init_weights",
    "load_model_factory",
    "packed_segments",
    "sequence_sharded",
]
