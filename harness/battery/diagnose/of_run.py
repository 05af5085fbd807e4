"""A battery run as the diagnosis's evidence: :func:`evidence_of` turns a :class:`~harness.battery.launch.run.Run`
(its records, reference chain, model spec and options) into :class:`harness.diagnosis.evidence.Evidence`, and
:func:`diagnose` and :func:`worst` read a run through it."""

from __future__ import annotations

from harness.battery.launch.run import Run, WindowRecord
from harness.battery.mesh_scenarios import microbatch_counts
from harness.battery.prepare.objective import auxiliary_of
from harness.battery.prepare.probe.facts import THREADS
from harness.core.mesh import MULTI_STAGE_SCHEDULES
from harness.diagnosis import diagnose as reading
from harness.diagnosis.evidence import Evidence, RankWindow
from harness.diagnosis.result import Diagnosis


def rank_window(rec: WindowRecord) -> RankWindow:
    """What the diagnosis reads of one rank's record of one window."""
    return RankWindow(grad=rec.grad, params_before=rec.params_before, syncs=rec.syncs, grad_norm=rec.grad_norm,
                      weights_changed=rec.weights_changed, weights_touched=rec.weights_touched, shards=rec.shards,
                      pipeline_steps=rec.pipeline_steps)


def evidence_of(run: Run) -> Evidence:
    """``run`` as the diagnosis reads it."""
    records = None if run.records is None else [[rank_window(rec) for rec in recs] for recs in run.records]
    return Evidence(
        windows=run.windows, records=records, model=run.spec, mesh=run.mesh, references=run.references,
        reference_starts=run.reference_starts, reference_norms=run.reference_norms, objective=run.objective,
        auxiliary=auxiliary_of(run.objective), strategy=run.run_spec.strategy if run.run_spec is not None else "ddp",
        precision=run.precision, max_norm=run.max_norm,
        chunking=run.run_spec.chunking if run.run_spec is not None else "contiguous", computes_in=run.computes_in,
        stages_per_rank=2 if run.run_spec is not None and run.run_spec.pp_schedule in MULTI_STAGE_SCHEDULES else 1,
        other_scenarios=microbatch_counts(run.mesh, run.run_spec.chunking if run.run_spec is not None else
                                          "contiguous"),
        noise_bound=None if run.bf16 is None else float(run.bf16.bound), threads=THREADS, recipe=run.recipe,
        scenario=run.scenario, notes=run.notes)


def diagnose(run: Run, window: int | None = None, rank: int | None = None,
             per_sequence: bool = False) -> Diagnosis | None:
    """:func:`harness.diagnosis.diagnose.diagnose` of ``run`` (default: its worst window and rank)."""
    return reading.diagnose(evidence_of(run), window, rank, per_sequence)


def worst(run: Run) -> tuple[int, int] | None:
    """``(window, rank)`` whose gradient is furthest from the reference (None: no gradient)."""
    return reading.worst(evidence_of(run))


__all__ = ["diagnose", "evidence_of", "rank_window", "worst"]
