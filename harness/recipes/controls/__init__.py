"""Negative controls: each reproduces a mistake real projects made and names where the battery must reject it.

One module per family (:data:`FAMILIES`): how the loss is normalized, how microbatches are accumulated, when gradients
synchronize, windows without tokens, what a step must leave alone (hygiene), the hf batch format, packed rows
(packed: a count from the rows' tokens, labels shifted across boundaries, for the loss, the count or both, a
sequence mean over rows), and mistakes that
depend on the world size (world: right at the W their author tested, declared where they show), recipes right
for one declared objective judged under another, or wrong for their own (objectives: a weighted mean over the count, a
normalizer from the local batch, auxiliary terms in the wrong unit), RL trainers' normalizations (dynamic:
token-budget micro-batches each divided by the rank's micro-batch count, a constant normalizer without the
data-parallel factor), how a recipe meets its strategy (strategies:
FSDP2's knobs, one strategy's no-sync under the other), clipping at the wrong moment or over the wrong gradient
(clipping), counts reduced over the wrong group of a dp x cp mesh (context_parallel), mistakes that need HSDP's
two data-parallel dimensions (hsdp: a factor for the shard group alone, a norm summed over the replicas), and the
groups of a tensor-parallel mesh (tensor_parallel: a count over tp too, the world size for the dp size, norms'
gradients not reduced over tp, a clipping norm from local shards), per-token losses on logits sharded over the
vocabulary (loss_parallel: a smoothing term over the local vocabulary, log-probs from log_softmax under
loss_parallel), and the schedules of a pipeline (pipeline:
``scale_grads`` left on with accumulation over schedule steps or with a global count, stages re-initialised, a count
over dp x pp, each schedule microbatch's own mean), and a transformers mixture-of-experts model's router auxiliary
loss as ``Trainer`` accumulates it (transformers_moe: the model's ``coef * aux_loss`` in every microbatch's loss,
times W, never divided by the accumulation steps), and the built-in MoE model's router terms in each unit
(router_terms: a per-microbatch term never divided by k, a global one averaged over the data ranks, a per-sequence one
averaged over each microbatch's rows, a per-token one never divided by N). A control is one
class in one of them, decorated with ``@control(Target(...), diagnosis)`` (:mod:`harness.recipes.catalog`); the tables
here are derived from the decorators, and ``harness.recipes:<name>`` names the class (each rank builds its own).
``tests/distributed/test_negative_controls.py`` shows every registered control rejected, and
``tests/unit/test_control_catalog.py`` fails on a family module not listed here or a recipe-shaped class without
its decorator.

Mistakes outside the recipe contract have their controls beside what they break: the resume mistakes are
``harness.training.trainer.RESUME_BUGS``; rank symmetry (a skipped collective, Join) and sampling are in
``tests/support/`` (``symmetry.py``, ``sampling.py``).
"""

from __future__ import annotations

from harness.recipes.catalog import REGISTRY, Target, diagnoses, scenario_controls, targets
from harness.recipes.controls import (
    accumulation,
    clipping,
    context_parallel,
    dynamic,
    empty,
    expert_parallel,
    hf,
    hsdp,
    hygiene,
    loss_parallel,
    normalization,
    objectives,
    packed,
    pipeline,
    router_terms,
    strategies,
    sync,
    tensor_parallel,
    transformers_moe,
    world,
)

FAMILIES = (normalization, accumulation, sync, empty, hygiene, hf, packed, world, objectives, dynamic, strategies,
            clipping,
            context_parallel, hsdp, tensor_parallel, loss_parallel, pipeline, expert_parallel, transformers_moe,
            router_terms)
"""Every module that defines controls, in the order the battery lists them."""

CONTROLS: dict[str, Target] = targets()
"""Every negative control (``harness.recipes:<name>``) and where the battery must reject it, derived from the
``@control`` each class carries."""

NEGATIVE_CONTROLS = tuple(CONTROLS)

DIAGNOSES: dict[str, str | None] = diagnoses()
"""The signature the gradient diagnosis (:mod:`harness.battery.diagnose.of_run`) must give each control on its target:
its weights, read off the numbers. None where the run leaves no gradient to read (a desync; a window without tokens).
A control whose mistake is not in the gradient (a sync count, a random generator, the logged loss) reads
``correct``: the diagnosis never blames the weights for what another check catches."""

SCENARIO_CONTROLS: dict[str, str] = scenario_controls()
"""For each scenario but the base one (``uneven``), the control that only that scenario catches: it passes every
other scenario of the battery (``tests/distributed/test_negative_controls.py`` shows both)."""


def control_class(name: str) -> type:
    """The class registered as control ``name`` (or the class of that name); AttributeError naming the controls
    otherwise."""
    entry = REGISTRY.get(name) or next((e for e in REGISTRY.values() if e.cls.__name__ == name), None)
    if entry is None:
        msg = f"no negative control named {name!r}; the controls are: {', '.join(REGISTRY)}"
        raise AttributeError(msg)
    return entry.cls


__all__ = ["CONTROLS", "DIAGNOSES", "FAMILIES", "NEGATIVE_CONTROLS", "SCENARIO_CONTROLS", "Target", "control_class"]
