"""transformers' mixture-of-experts causal LMs, built from a config, trained with their own router auxiliary loss.

Tested with transformers 5.25.0 (torch 2.13.0). Two ``--model`` factories build a randomly initialized model at the
battery's size (no weights are downloaded): :func:`tiny_mixtral` (``MixtralForCausalLM``) and :func:`tiny_qwen2_moe`
(``Qwen2MoeForCausalLM``, with its shared expert): hidden 32, 4 experts, top-2, 2 layers, the battery's vocabulary,
dropout and router jitter off, the eager experts (``experts_implementation="eager"``: :data:`_SIZES` says why),
``output_router_logits=True`` and ``router_aux_loss_coef`` = :data:`ROUTER_AUX_LOSS_COEF`
in the config. Their weights come from torch's global generator, which the harness seeds right before the call; each
declares its ``moe_plan`` (experts ``model.layers.*.mlp.experts``, router ``model.layers.*.mlp.gate``). They take the
``hf`` batch format (``--batch-format hf``); the recipes below also take the harness's own microbatches, which they
turn into that form (:func:`harness.core.formats.to_hf`).

What the model computes, read from ``transformers.models.mixtral.modeling_mixtral`` (Qwen2-MoE and Qwen3-MoE hold the
same ``load_balancing_loss_func``, line for line) and measured (``tests/integrations/test_transformers_moe.py``):

- ``outputs.aux_loss`` is the Switch load-balancing term of *one forward*: ``E * sum_e f_e * P_e``, ``f_e`` the
  fraction of the tokens' top-k slots that chose expert ``e`` and ``P_e`` its mean router probability, each pooled
  over every layer before the product (not a mean of per-layer products). ``f`` sums over the k slots, so uniform
  routing gives k (2 here), not 1. It masks padding with the ``attention_mask`` it is given, and nothing else: every
  attended token counts, prompt tokens and a row's last token (which predicts nothing) included; without a mask,
  padding counts too.
- Given ``labels``, ``outputs.loss`` is the token loss (``ForCausalLMLoss``: the sum over ``num_items_in_batch`` when
  passed, else the microbatch's own mean) *plus* ``router_aux_loss_coef * aux_loss``, added on every forward, that
  is on every microbatch.
- ``Trainer`` (``training_step``) divides the loss by the accumulation steps only when the model does not take loss
  keywords or no ``num_items_in_batch`` was counted; a causal LM takes them, so the loss is not divided, and under
  ``average_tokens_across_devices=True`` (the default) it is multiplied by the number of processes W. The token part
  is then the global token mean; the router part, ``coef * aux_loss`` of each microbatch backpropagated times W and
  never divided by the k microbatches, weighs ``W * k`` times a per-microbatch mean's share (4x at W=2, k=2): the
  mistake :class:`harness.recipes.controls.transformers_moe.TrainerRouterLossPerMicrobatch` keeps, read
  ``auxiliary_misweighted``.

The right step (:class:`RouterAuxLossTokenMean`, a loop of one's own): the token loss over the all-reduced supervised
count (times W for DDP's average), and ``coef * outputs.aux_loss / k`` per microbatch: the router term averaged over
every microbatch of every rank, its unit the microbatch (``auxiliary_unit = "microbatch"``). Inside ``Trainer``
(:class:`TrainerRouterLossPerWindow`): a ``compute_loss`` that takes the router term back out of the model's loss
(times W) and adds it divided by ``current_gradient_accumulation_steps`` (:func:`router_loss_trainer`). Run either
through the battery with::

    python -m harness battery --model harness.recipes.libraries.transformers_moe:tiny_mixtral --batch-format hf \\
        --recipe harness.recipes.libraries.transformers_moe:transformers_moe_router_loss --quick

transformers is imported inside the functions that need it, never with this module (the controls' family module
imports it, and every rank imports the controls).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from harness.core.formats import to_hf
from harness.core.microbatch import PAD, Microbatch
from harness.data.config import Config
from harness.moe_plan import MoePlan, unwrapped
from harness.recipes.correct import _world_size, global_sum
from harness.recipes.helpers import global_count, require_tokens, supervised_tokens, sync_context
from harness.recipes.libraries._common import missing

ROUTER_AUX_LOSS_COEF = 0.02
"""The factories' ``router_aux_loss_coef`` (``MixtralConfig``'s default is 0.001; at 0.02 the router term's gradient
stands well above the float32 lane's tolerances)."""

MOE_PLAN = MoePlan(experts=("model.layers.*.mlp.experts",), router=("model.layers.*.mlp.gate",))
"""Where transformers' Mixtral and Qwen-MoE blocks keep their experts (one module holding every expert's weights as
``[E, ...]`` tensors) and their router (a ``gate`` of ``E`` logits); Qwen2-MoE's shared expert is neither."""

_SIZES: dict[str, Any] = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                          "num_experts_per_tok": 2, "max_position_embeddings": 128, "attention_dropout": 0.0,
                          "pad_token_id": PAD, "output_router_logits": True, "router_aux_loss_coef":
                          ROUTER_AUX_LOSS_COEF, "experts_implementation": "eager"}
"""The factories' shared settings. ``experts_implementation="eager"`` (one matmul per expert): transformers 5.25's
default, ``grouped_mm``, calls ``torch._grouped_mm``, which on torch 2.13's CPU refuses float64 ("Expected mat_a to
be Float32, BFloat16 or Float16 matrix, got Double"), and the harness's float64 lane and gradient diagnosis run the
model in float64; eager and grouped_mm agree to 1e-7 in float32."""


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as e:
        raise missing("transformers") from e
    return transformers


def tiny_mixtral() -> nn.Module:
    """``MixtralForCausalLM`` from a config at the battery's size: 2 layers of width 32, 4 experts of width 64 under
    top-2 routing, the battery config's vocabulary, no router jitter; ``output_router_logits=True`` and
    ``router_aux_loss_coef`` :data:`ROUTER_AUX_LOSS_COEF`. Weights from torch's global generator."""
    t = _transformers()
    config = t.MixtralConfig(vocab_size=Config().vocab_size, intermediate_size=64, num_local_experts=4,
                             router_jitter_noise=0.0, **_SIZES)
    return t.MixtralForCausalLM(config)


def tiny_qwen2_moe() -> nn.Module:
    """``Qwen2MoeForCausalLM`` from a config at the battery's size: 2 layers of width 32, 4 experts of width 32 under
    top-2 routing (no renormalization of the top-k probabilities, Qwen2-MoE's default), a shared expert of width 64
    behind its sigmoid gate, every layer sparse; the router settings as :func:`tiny_mixtral`'s."""
    t = _transformers()
    config = t.Qwen2MoeConfig(vocab_size=Config().vocab_size, intermediate_size=64, moe_intermediate_size=32,
                              shared_expert_intermediate_size=64, num_experts=4, decoder_sparse_step=1, **_SIZES)
    return t.Qwen2MoeForCausalLM(config)


tiny_mixtral.moe_plan = MOE_PLAN  # type: ignore[attr-defined]
tiny_qwen2_moe.moe_plan = MOE_PLAN  # type: ignore[attr-defined]


def _hf(batch: Any) -> Mapping[str, torch.Tensor]:
    """The hf dict of a batch: itself (``--batch-format hf``), or a harness :class:`Microbatch`'s :func:`to_hf` form
    (the same (position, target) pairs and count, with the attention mask the router loss reads)."""
    if isinstance(batch, Microbatch):
        return to_hf(batch)
    if not isinstance(batch, Mapping) or "attention_mask" not in batch:
        msg = (f"a transformers MoE recipe takes hf batches (input_ids, attention_mask, labels) or harness "
               f"Microbatches, got {type(batch).__name__}"
               f"{' without an attention_mask (packed rows)' if isinstance(batch, Mapping) else ''}: run it with "
               "--batch-format hf")
        raise TypeError(msg)
    return batch


def coefficient(model: nn.Module) -> float:
    """The model's own ``router_aux_loss_coef`` (inside a DDP wrapper too); ValueError naming the attribute on a
    model without one."""
    coef = getattr(unwrapped(model), "router_aux_loss_coef", None)
    if not isinstance(coef, (int, float)) or isinstance(coef, bool):
        msg = (f"the model ({type(unwrapped(model)).__name__}) has no router_aux_loss_coef: these recipes train a "
               "transformers mixture-of-experts causal LM (MixtralForCausalLM, Qwen2MoeForCausalLM, ...)")
        raise ValueError(msg)
    return float(coef)


def router_forward(model: nn.Module, batch: Mapping[str, torch.Tensor]) -> Any:
    """The model's forward of an hf batch with its router logits: ``outputs.logits`` and ``outputs.aux_loss``
    (the load-balancing term over the batch's attended tokens). No labels: the token loss is the recipe's."""
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], output_router_logits=True)
    if not isinstance(getattr(out, "aux_loss", None), torch.Tensor):
        msg = (f"the model ({type(unwrapped(model)).__name__}) returned no aux_loss with output_router_logits=True: "
               "it is not a transformers mixture-of-experts causal LM")
        raise ValueError(msg)
    return out


def token_loss(model: nn.Module, logits: torch.Tensor, labels: torch.Tensor, tokens: int) -> torch.Tensor:
    """The model's own causal-LM loss (``model.loss_function``, transformers' ``ForCausalLMLoss``: the shift, then the
    cross-entropy sum over ``num_items_in_batch``) with ``tokens``, the window's global supervised count."""
    inner: Any = unwrapped(model)
    loss: torch.Tensor = inner.loss_function(logits, labels, vocab_size=inner.config.vocab_size,
                                             num_items_in_batch=torch.tensor(tokens))
    return loss


class RouterAuxLossTokenMean:
    """The token mean over the global window plus the model's router auxiliary loss averaged over every microbatch
    of every rank, the way a transformers user writes it with ``output_router_logits=True``: for each microbatch,
    ``W * ForCausalLMLoss(logits, labels, num_items_in_batch=N) + router_aux_loss_coef * outputs.aux_loss / k``,
    ``N`` the all-reduced supervised count, ``k`` this rank's microbatches, ``no_sync()`` around all but the last.
    DDP's average over the W ranks turns the first into the global token mean and the second into the mean over the
    ``W * k`` microbatches."""

    name = "transformers_moe_router_loss"
    auxiliary_unit = "microbatch"

    def setup(self) -> None:
        _transformers()

    def auxiliary_loss(self, model: nn.Module, batch: Any, logits: torch.Tensor) -> torch.Tensor:
        """``router_aux_loss_coef * outputs.aux_loss`` of ``batch``'s forward: the term the reference adds, one value
        per microbatch. The model's forward is computed again (without labels it is a fixed function of the
        batch and the weights, so the value and its gradient are the ones of the forward that gave ``logits``)."""
        return coefficient(model) * router_forward(model, _hf(batch)).aux_loss

    def microbatch_loss(self, model: nn.Module, batch: Mapping[str, torch.Tensor], tokens: int,
                        k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(what this rank backpropagates, its share of the objective's value)`` for one microbatch."""
        out = router_forward(model, batch)
        main = token_loss(model, out.logits, batch["labels"], tokens)
        aux = coefficient(model) * out.aux_loss / k
        world = _world_size()
        # W: DDP averages the ranks' gradients, and the token mean's normalizer is already global. The router term
        # is a per-microbatch mean with no global normalizer: its 1/k and DDP's 1/W make the mean over W * k.
        return main * world + aux, main.detach() + aux.detach() / world

    def backward_window(self, model: nn.Module, window: Sequence[Any]) -> float:
        batches = [_hf(mb) for mb in window]
        tokens = require_tokens(global_count(sum(supervised_tokens(mb) for mb in batches)))
        local = 0.0
        for i, batch in enumerate(batches):
            with sync_context(model, i, len(batches)):
                loss, share = self.microbatch_loss(model, batch, tokens, len(batches))
                loss.backward()
            local += float(share)
        return global_sum(local)


def router_loss_trainer() -> type:
    """A ``transformers.Trainer`` whose ``compute_loss`` weighs the model's router term as one value per microbatch:
    ``Trainer.compute_loss`` returns the model's loss, ``router_aux_loss_coef * aux_loss`` included, times W (under
    ``average_tokens_across_devices`` with a counted ``num_items_in_batch``), and ``training_step`` does not divide
    it by the accumulation steps k; this one takes the router term back out and adds it divided by k instead."""
    t = _transformers()

    class RouterLossTrainer(t.Trainer):  # type: ignore[name-defined]
        def compute_loss(self, model: nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                         num_items_in_batch: Any = None) -> Any:
            loss, outputs = super().compute_loss(model, inputs, return_outputs=True,
                                                 num_items_in_batch=num_items_in_batch)
            aux = getattr(outputs, "aux_loss", None)
            if aux is not None and "labels" in inputs:  # the model added coef * aux_loss to its loss
                router = coefficient(model) * aux
                scaled = self.args.average_tokens_across_devices and num_items_in_batch is not None
                world = self.accelerator.num_processes if scaled and self.model_accepts_loss_kwargs else 1
                loss = loss - router * world + router / self.current_gradient_accumulation_steps
            return (loss, outputs) if return_outputs else loss

    return RouterLossTrainer


class TrainerRouterLossPerWindow:
    """``Trainer``'s own inner loop (``get_batch_samples``, ``training_step`` under ``no_sync`` but the last,
    ``average_tokens_across_devices=True``) with :func:`router_loss_trainer`'s ``compute_loss``: the token part as the
    Trainer computes it (the global token mean), the router term ``coef * aux_loss / k`` per microbatch. The fix of
    :class:`harness.recipes.controls.transformers_moe.TrainerRouterLossPerMicrobatch`, inside the Trainer."""

    name = "transformers_moe_trainer_router_loss"
    auxiliary_unit = "microbatch"
    trainer: Any = staticmethod(router_loss_trainer)
    """What builds the Trainer class the loop runs (None: transformers' own ``Trainer``)."""

    def __init__(self) -> None:
        self.loop: Any = None

    def setup(self, model: nn.Module | None = None) -> None:
        from harness.recipes.libraries.transformers_loss import TransformersGlobalItemsHF

        self.loop = TransformersGlobalItemsHF()
        if self.trainer is not None:
            self.loop.trainer_class = self.trainer()
        self.loop.setup(model)

    def auxiliary_loss(self, model: nn.Module, batch: Any, logits: torch.Tensor) -> torch.Tensor:
        return RouterAuxLossTokenMean().auxiliary_loss(model, batch, logits)

    def backward_window(self, model: nn.Module, window: Sequence[Any]) -> float:
        if self.loop is None:
            self.setup()
        return float(self.loop.backward_window(model, window))


transformers_moe_router_loss = RouterAuxLossTokenMean
transformers_moe_trainer_router_loss = TrainerRouterLossPerWindow

__all__ = ["MOE_PLAN", "ROUTER_AUX_LOSS_COEF", "RouterAuxLossTokenMean", "TrainerRouterLossPerWindow", "coefficient",
           "router_forward", "router_loss_trainer", "tiny_mixtral", "tiny_qwen2_moe", "token_loss",
           "transformers_moe_router_loss", "transformers_moe_trainer_router_loss"]
