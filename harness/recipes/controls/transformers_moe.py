"""Negative controls, transformers MoE family: a transformers mixture-of-experts model's router auxiliary loss
(``outputs.aux_loss`` with ``output_router_logits=True``) accumulated the way ``Trainer`` does.

Each class declares where the battery rejects it and what the diagnosis reads in its gradient (``@control``,
:mod:`harness.recipes.catalog`); ``harness.recipes:<name>`` names it. transformers is imported when a rank sets the
control up, never with this module."""

from __future__ import annotations

from harness.core.formats import HF
from harness.recipes.catalog import Target, control
from harness.recipes.libraries.transformers_moe import TrainerRouterLossPerWindow

MIXTRAL = "harness.recipes.libraries.transformers_moe:tiny_mixtral"
"""The ``--model`` these controls need: a transformers Mixtral built from a config with ``output_router_logits``."""


@control(Target("parity", "uneven", batch_format=HF, model=MIXTRAL, library="transformers"), "auxiliary_misweighted")
class TrainerRouterLossPerMicrobatch(TrainerRouterLossPerWindow):
    """``Trainer``'s own inner loop (``get_batch_samples``, then ``training_step`` per microbatch under ``no_sync``
    but the last, ``average_tokens_across_devices=True``, the 5.x default) on a Mixtral whose config sets
    ``output_router_logits=True``: the model adds ``router_aux_loss_coef * aux_loss`` to every microbatch's loss, and
    the Trainer, seeing a loss already normalized by ``num_items_in_batch``, multiplies the whole loss by W and never
    divides it by the accumulation steps. The token part is right; the router term, one value per microbatch,
    weighs ``W * k`` times its per-microbatch mean (measured with transformers 5.25.0: 4x at W=2, k=2). The declared
    term is the one a single-microbatch step gives it, ``coef * aux_loss`` averaged over the window's microbatches
    (:class:`~harness.recipes.libraries.transformers_moe.RouterAuxLossTokenMean`). The k is NeMo Automodel PR
    #3359's mistake (a model-provided MoE auxiliary loss in every microbatch's backward without the accumulation's
    normalization); the W is transformers issue #48690's (the router loss multiplied by the DDP world size)."""

    name = "trainer_router_loss_per_microbatch"
    trainer = None


__all__ = ["MIXTRAL", "TrainerRouterLossPerMicrobatch"]
