"""Preparation: the parent's half of a run, before any rank starts (:func:`prepare`). In order: the declared
objective and the windows it needs, the warmed starting weights, what a user's model allows (its fingerprint and its
probe), the reference chain (:mod:`harness.battery.prepare.chain`), the bf16 lane's measured noise
(:mod:`harness.battery.prepare.bf16`), and the notes on parameters without a gradient
(:mod:`harness.battery.prepare.probe.gradless`). What it decides travels as one :class:`Prepared` to either launcher:
the in-process one (:func:`harness.battery.launch.runner.launch_run`) and torchrun's workers
(:mod:`harness.battery.dist`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

import torch

from harness.battery import scenarios
from harness.battery.launch.run import Run, WindowRecord
from harness.battery.plan.options import RunSpec
from harness.battery.prepare import bf16
from harness.battery.prepare.chain import Chain, compute_chain
from harness.battery.prepare.objective import resolve, windows_for
from harness.battery.prepare.probe.facts import probe as probe_once
from harness.battery.prepare.probe.facts import probe_meshes, probe_model
from harness.battery.prepare.probe.gradless import unused_notes
from harness.battery.prepare.start import start_note, start_weights
from harness.battery.spec import ModelSpec, weights_digest
from harness.core.formats import HF, PACKED
from harness.core.objectives import PLAIN, Objective
from harness.distributed import strategies
from harness.distributed.expert_parallel import plans_of as expert_plans_of
from harness.distributed.launcher import LaunchError
from harness.distributed.sequence_sharding import plan_of as sequence_plan_of
from harness.distributed.tensor_parallel import plan_of, recipe_plan
from harness.model import ModelError
from harness.moe_plan import plan_of as moe_plan_of
from harness.recipes import load_recipe
from harness.recipes.contract import clips

_NOISE: dict[tuple[object, ...], Any] = {}
"""The bf16 lane's measured noise (:class:`harness.battery.prepare.bf16.Noise`) by case, model, objective and
strategy."""

_CHAINS: dict[tuple[object, ...], Chain] = {}
"""Reference chains of named scenarios, by (scenario, mesh, model spec, objective, clipping, precision): every recipe
judged on one case (the recipe under test and each negative control) is compared with the same reference, computed
once per process."""


@dataclass(frozen=True)
class Prepared:
    """What the parent decides before any rank starts, for one run: the model the ranks build (with the fingerprint
    of its initial weights when it is a user's), the reference chain, whether DDP needs ``find_unused_parameters``
    (``wrap``), and what the harness found about the model (``notes``, ``computes_in``). Both launchers use it: the
    in-process one (:func:`harness.battery.launch.runner.launch_run`) and torchrun's workers
    (:mod:`harness.battery.dist`)."""

    spec: RunSpec
    windows: scenarios.Windows
    model: ModelSpec
    chain: Chain
    wrap: bool
    notes: tuple[str, ...]
    computes_in: str | None
    objective: Objective = PLAIN
    noise: Any = None
    """The bf16 lane's measured noise and bound (:class:`harness.battery.prepare.bf16.Noise`); None in the other
    lanes."""
    start: torch.Tensor | None = None
    """The flat weights the ranks and the reference start from (:mod:`harness.battery.prepare.start`); None: the initial
    weights."""

    @property
    def digest(self) -> str | None:
        return self.model.digest

    def run(self, records: list[list[WindowRecord]] | None = None, **fields: Any) -> Run:
        """The :class:`Run` of this preparation with the ranks' ``records`` (or a ``failure`` / ``model_error``)."""
        s, chain = self.spec, self.chain
        fields.setdefault("notes", self.notes)
        return Run(s.recipe, s.scenario, s.world_size, s.precision, self.windows, records, chain.references,
                   init_seed=s.init_seed, model_path=s.model, batch_format=s.batch_format,
                   computes_in=self.computes_in, reference_starts=chain.starts, run_spec=s,
                   find_unused=self.wrap, objective=self.objective, max_norm=chain.max_norm,
                   reference_norms=chain.norms, bf16=self.noise, **fields)

    def failed(self, exc: LaunchError) -> Run:
        """The run whose ranks failed with ``exc`` (DDP's parameter indices named)."""
        return self.run(None, failure=exc, notes=self.notes + _named_indices(exc, self.chain.trainable))


def prepare(spec: RunSpec, windows: scenarios.Windows, *, share_chain: bool = False, probe: bool = False) -> Prepared:
    """The parent's half of a run (:class:`Prepared`), before any rank starts. ``share_chain``: ``windows`` are the
    named scenario's own (:func:`harness.battery.scenarios.build`), so the reference chain computed for another recipe
    on the same case is reused. ``probe``: the model's probe (:func:`harness.battery.prepare.probe.facts.probe`) runs
    first, so that a model that cannot be used raises :class:`~harness.model.ModelError` from here, before any rank
    (the command line's pre-flight asks for it: the session's preparation is then one stay)."""
    if probe:
        probe_once(spec.model, spec.batch_format)
    if spec.mesh.data_ranks != len(windows[0]):
        msg = (f"spec.world_size={spec.world_size} (mesh {spec.mesh.label}: {spec.mesh.data_ranks} distinct windows) "
               f"but the windows have {len(windows[0])} ranks")
        raise ValueError(msg)
    strategies.get(spec.strategy)  # an unknown name is refused here, not in every rank
    if spec.mesh.size("tp") > 1 and recipe_plan(load_recipe(spec.recipe)) is None:
        plan_of(spec.model)  # a user's model without a tensor-parallel plan is refused here, not in every rank
    if spec.mesh.size("ep") > 1:  # likewise a model without experts to spread over ep
        expert_plans_of(spec.model, load_recipe(spec.recipe))
    if spec.mesh.size("cp") > 1 and spec.batch_format in (HF, PACKED) and sequence_plan_of(spec.model) is not None:
        msg = (f"model={spec.model!r} shards the sequence (its cp_plan) and the batch format is {spec.batch_format}: "
               "a cp rank's chunk carries its positions in the harness format only (Microbatch.positions, passed as "
               "position_ids); run it with --batch-format harness")
        raise ModelError(msg)  # a ValueError: refused once on the command line, as a model that cannot be used
    refuse = getattr(sequence_plan_of(spec.model), "check", None) if spec.mesh.size("cp") > 1 else None
    if callable(refuse):  # a cp the model cannot shard over (Ulysses: one that does not divide its heads), likewise
        refuse(spec.mesh.size("cp"))
    if spec.mesh.size("pp") > 1:  # a split that loses part of the forward is refused here, not in every rank
        probe_meshes(spec.model, [spec.mesh], spec.batch_format, spec.pp_schedule)
    objective = resolve(spec.objective, spec.recipe)
    windows = windows_for(spec, windows)  # the objective's factors, drawn where the windows carry none
    model = ModelSpec.of(spec)
    notes: tuple[str, ...] = ()
    # Every lane starts from the warmed weights of the ranks' own precision (the bf16 lane: float32, its float64
    # truth the same numbers cast), so that per-token losses differ (harness.battery.prepare.start).
    start = start_weights(model)
    if start_note(model):
        notes += (str(start_note(model)),)
    computes_in = None
    found = None
    refused = float64_refusal(spec) if spec.precision in ("fp64", "bf16") else None
    if refused is not None:  # the lane's truth is float64: its cases are n/a, naming why, and no rank starts
        return Prepared(spec, windows, model, Chain([], [], (), model_error=refused), False, (refused, *notes), None,
                        objective, None, start)
    if spec.model is not None:  # every rank must rebuild the weights the reference starts from
        digest = weights_digest(model.build())
        found = probe_model(model)
        computes_in = found.computes_in
        notes = found.notes(unused=False) + notes  # the chain says which parameters miss a gradient, and where
        model = ModelSpec.of(spec, digest)
    clip = clips(load_recipe(spec.recipe))
    # The bf16 lane is judged against float64: its chain is the float64 one, and its bound comes from the noise.
    truth = replace(model, precision="fp64") if spec.precision == "bf16" else model
    # By the mesh, not the world size: a dp=2,cp=2 run's windows are two data coordinates', a dp=4 run's four; by the
    # chunking too (a mesh scenario masks the positions of a chunk). bf16 starts at float32's weights.
    key = (spec.scenario, spec.mesh, spec.chunking, truth, objective, clip, spec.precision)
    chain = _CHAINS.get(key) if share_chain else None
    if chain is None:
        chain = compute_chain(windows, truth.precision, spec.init_seed, truth, objective, clip=clip, start=start)
        if share_chain and len(_CHAINS) < 64:
            _CHAINS[key] = chain
    noise = None
    if spec.precision == "bf16" and chain.model_error is None:
        noise_key = (spec.scenario, spec.mesh, spec.chunking, model, objective, spec.strategy)
        noise = _NOISE.get(noise_key) if share_chain else None
        if noise is None:
            noise = bf16.measure_noise(model, windows, spec.strategy,
                                       lambda m: bf16.gradient_function(m, objective), objective)
            if share_chain and len(_NOISE) < 64:
                _NOISE[noise_key] = noise
    wrap = False
    if chain.model_error is None:
        needs, unused = unused_notes(chain, found.gradless if found is not None else ())
        # A window without any supervised token gives the reference no backward to see the unused parameters in:
        # the model probe's own finding decides there, so that a loop that still runs its forward and backward on
        # such a window meets the same DDP as on every other scenario.
        gradless = bool(found.gradless) if found is not None else False
        wrap = spec.find_unused == "on" or (spec.find_unused == "auto" and (needs or gradless))
        if not wrap and spec.find_unused == "auto" and spec.strategy == "ddp" and moe_plan_of(spec.model) is not None:
            # Routing may leave an expert without a token in any microbatch, on weights the reference never visits
            # (after a wrong step): DDP without find_unused_parameters then stops the run at the next forward.
            wrap = True
            notes += ("the model declares experts (its moe_plan): routing may leave an expert without a token in any "
                      "microbatch, so the ranks' DDP runs with find_unused_parameters=True here (--find-unused-"
                      "parameters auto), and your training code needs it too",)
        if needs:
            how = ("the ranks' DDP runs with it here (--find-unused-parameters auto), and your training code needs "
                   "it too, or every parameter a gradient" if wrap else
                   "the ranks' DDP runs without it here (--find-unused-parameters off): DDP then never finishes the "
                   "reduction of a rank that misses a gradient while the others wait for it (use auto or on)")
            if spec.strategy == "fsdp2":
                notes += (*unused, "under FSDP2 the ranks shard the model as one group here (a module no forward "
                          "reaches is never gathered, and its gradients cannot be accumulated under a "
                          "mixed-precision policy); under DDP it needs find_unused_parameters=True")
            else:
                notes += (*unused, f"the model therefore needs DDP's find_unused_parameters=True: {how}")
    return Prepared(spec, windows, model, chain, wrap, notes, computes_in, objective, noise, start)


def float64_refusal(spec: RunSpec) -> str | None:
    """Why ``spec``'s lane cannot be judged on its model, where the lane computes its truth in float64 (the fp64 lane,
    and the bf16 lane's reference) and the model cannot run there (the probe's backward check found its float64
    forward raising: transformers' ``grouped_mm`` experts on a CPU torch); None: it can."""
    if spec.model is None:
        return None
    check = probe_once(spec.model, spec.batch_format).backward
    if check is None or check.not_float64 is None:
        return None
    lane = "the fp64 lane" if spec.precision == "fp64" else "the bf16 lane (judged against float64)"
    return (f"the model cannot run in float64 ({check.not_float64}): {lane} computes its reference there, so it is "
            "not judged on this model; the fp32 lane is (a float64-capable path of the model, such as transformers' "
            "experts_implementation='eager', opens it)")


_DDP_INDICES = re.compile(r"Parameter indices which did not receive grad for rank (\d+): ([\d ]+)")


def _named_indices(exc: LaunchError, trainable: tuple[str, ...]) -> tuple[str, ...]:
    """DDP names the parameters that got no gradient by index only (its names need TORCH_DISTRIBUTED_DEBUG, whose
    DETAIL level crashes forkserver ranks): the names, in the order DDP counts them (the parameters that require
    grad)."""
    out = []
    for rank, indices in sorted(set(_DDP_INDICES.findall("\n".join(exc.details.values())))):
        names = [trainable[int(i)] for i in indices.split() if int(i) < len(trainable)]
        if names:
            out.append(f"DDP's parameter indices {', '.join(indices.split())} without a gradient on rank {rank} are "
                       f"the model's {', '.join(names)}")
    return tuple(out)
