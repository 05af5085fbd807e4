"""What a pipelined run's wrong gradient is, read by the formula of each known accumulation mistake over the schedule
steps the rank recorded (:attr:`harness.battery.run.WindowRecord.pipeline_steps`).

A window on a mesh with pp runs as A ``schedule.step`` calls, step ``a`` with ``M_a`` microbatches and its own
``scale_grads``; each of the window's microbatches lies in one step. With ``d_b = 1/M_b`` where step ``b`` scales its
gradients (1 where it does not), the fitted ratios ``q = w * N`` of a step-``a`` microbatch are, under each mistake:

- ``pp_scale_grads`` (torchtitan #1733): ``prod_{b > a} d_b``, the loss right for one step but every later step's
  division applied again to the gradient accumulated so far: ``1/M^(A-1-a)``, an exponential moving average;
- ``pp_last_step_only`` (NeMo Automodel #3530): 1 in the last step, 0 before it (the gradients cleared between steps);
- ``pp_divided_by_microbatches``: ``prod_{b >= a} d_b``, a loss already divided by the window's count under the
  default ``scale_grads=True`` (every weight ``1/M`` in a window of one step);
- ``count_group`` over pp: every weight ``1/pp``, the count reduced over the pp ranks too, which hold the same tokens
  (over dp x pp :func:`harness.core.count_groups.count_group` names it first; over pp alone it does not apply).

:func:`formula_reading` is pure arithmetic on the fit's numbers (``tests/unit/test_pipeline_diagnosis.py``);
:func:`pipeline_reading` applies it to a run's fit where the microbatch fit explains the gradient but does not read
correct.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from harness.battery.run import Run
from harness.core.fit import Block, Fit, explained_residual, match_tolerance
from harness.core.signatures import Signature
from harness.distributed.pipeline import ScheduleStep

LEFT_AS_READ = ("correct", "float32_computation", "count_group", "weights_edited", "nonfinite", "model_not_fixed")
"""Readings a formula never replaces: right weights, and what is named from stronger evidence."""


def step_of(block: Block, steps: Sequence[ScheduleStep]) -> int | None:
    """The step whose batch held every row of ``block``'s microbatch (None: none, or its rows spread over several)."""
    held = {a for a, s in enumerate(steps) for m, _ in s.rows if m == block.microbatch}
    rows = {j for s in steps for m, j in s.rows if m == block.microbatch}
    if len(held) != 1 or (block.rows and rows != set(range(block.rows))):
        return None
    return held.pop()


def _factors(steps: Sequence[ScheduleStep]) -> list[float]:
    return [1 / s.n_microbatches if s.scale_grads and s.n_microbatches > 0 else 1.0 for s in steps]


def _formulas(steps: Sequence[ScheduleStep], pp: int) -> dict[str, list[float]]:
    """Each mistake's ratio for a microbatch of each step of ``steps``."""
    d, last = _factors(steps), len(steps) - 1
    return {"pp_scale_grads": [math.prod(d[a + 1:]) for a in range(len(steps))],
            "pp_last_step_only": [1.0 if a == last else 0.0 for a in range(len(steps))],
            "pp_divided_by_microbatches": [math.prod(d[a:]) for a in range(len(steps))],
            "count_group": [1 / pp] * len(steps)}


def _words(name: str, steps: Sequence[ScheduleStep], ratios: Sequence[float], pp: int) -> str:
    a_steps = len(steps)
    ms = {s.n_microbatches for s in steps}
    weighs = ", ".join(f"step {a}'s{' gradient weighs' if a == 0 else ''} "
                       + (f"1/M^{a_steps - 1 - a} = {r:.3g}" if name == "pp_scale_grads" and len(ms) == 1
                          and a < a_steps - 1 else f"{r:.3g}") for a, r in enumerate(ratios))
    held = "; ".join(f"step {a}: M={s.n_microbatches}, scale_grads={s.scale_grads}, microbatch"
                     f"{'es' if len({m for m, _ in s.rows}) != 1 else ''} "
                     f"{', '.join(str(m) for m in sorted({m for m, _ in s.rows})) or 'none'}"
                     for a, s in enumerate(steps))
    if name == "pp_scale_grads":
        return (f"scale_grads rescaled each step: an exponential moving average over the window's {a_steps} steps "
                f"({weighs}), where the sum belongs: every step's scale_grads=True divided the gradients accumulated "
                f"so far by its M (torchtitan #1733); with a loss divided by the window's count pass "
                f"scale_grads=False ({held})")
    if name == "pp_last_step_only":
        return (f"only the last step's gradient survived: {weighs}; the gradients were cleared between the "
                f"window's {a_steps} schedule steps (stages re-initialised or grads zeroed: NeMo Automodel #3530) "
                f"({held})")
    if name == "pp_divided_by_microbatches":
        return (f"a loss already divided by the window's count, and scale_grads=True divided each step's gradient "
                f"by M again ({weighs}): pass scale_grads=False with a global count ({held})")
    return (f"the count was reduced over pp ({pp} ranks), which hold the same tokens: every weight is {1 / pp:.3g}x; "
            "reduce the count over the token group (dp), never pp")


def formula_reading(blocks: Sequence[Block], q: Sequence[float], steps_by_rank: Mapping[int, Sequence[ScheduleStep]],
                    pp: int) -> Signature | None:
    """The first mistake whose formula gives the ratios ``q`` (one per block, ``w * N``) of ``blocks`` (a block's
    ``rank`` its token rank, whose recorded steps are ``steps_by_rank[rank]``), within the match tolerance relative to
    the largest predicted ratio; a formula that predicts the right weights everywhere is no candidate, and the others
    that give the same numbers are named beside it. None: no formula explains them, or a supervised block lies in no
    single step or a step held rows of its own (``foreign``)."""
    live = [(b, v) for b, v in zip(blocks, q, strict=True) if b.tokens > 0 and math.isfinite(v)]
    if not live or any(b.rank not in steps_by_rank for b, _ in live):
        return None
    if any(s.foreign for steps in steps_by_rank.values() for s in steps):  # rows the window does not hold
        return None
    at = [step_of(b, steps_by_rank[b.rank]) for b, _ in live]
    if any(a is None for a in at):
        return None
    formulas = {t: _formulas(s, pp) for t, s in steps_by_rank.items()}
    matched = []
    for name in formulas[live[0][0].rank]:
        p = [formulas[b.rank][name][a] for (b, _), a in zip(live, at, strict=True) if a is not None]
        top = max(abs(x) for x in p)
        if top == 0 or all(abs(x - 1) <= match_tolerance() for x in p):
            continue
        if max(abs(v - x) for (_, v), x in zip(live, p, strict=True)) <= match_tolerance() * top:
            matched.append(name)
    if not matched:
        return None
    rank = live[0][0].rank
    steps = steps_by_rank[rank]
    sentence = _words(matched[0], steps, formulas[rank][matched[0]], pp)
    if len(matched) > 1:
        sentence += f"; the same numbers also read {' and '.join(matched[1:])}"
    return Signature(matched[0], sentence)


def pipeline_reading(run: Run, window: int, blocks: Sequence[Block], fit: Fit, sig: Signature) -> Signature:
    """``sig``, or on a mesh with pp where the microbatch fit explains the gradient and reads neither correct nor a
    stronger reading (:data:`LEFT_AS_READ`), the mistake whose formula over the recorded steps gives its weights."""
    pp = run.mesh.size("pp")
    if pp < 2 or run.records is None or sig.name in LEFT_AS_READ or fit.residual > explained_residual():
        return sig
    n = sum(b.tokens for b in blocks)
    steps_by_rank = {}
    for t in {b.rank for b in blocks}:
        records = run.records[run.mesh.holder(t)]
        if window >= len(records) or not records[window].pipeline_steps:
            return sig
        steps_by_rank[t] = records[window].pipeline_steps
    found = formula_reading(blocks, [float(w) * n for w in fit.weights], steps_by_rank, pp)
    return sig if found is None else found


__all__ = ["LEFT_AS_READ", "formula_reading", "pipeline_reading", "step_of"]
