"""What a pipelined run's wrong gradient is, read by the formula of each known accumulation mistake over the schedule
steps the rank recorded (:attr:`harness.diagnosis.evidence.RankWindow.pipeline_steps`).

A window on a mesh with pp runs as A ``schedule.step`` calls, step ``a`` with ``M_a`` microbatches and its own
``scale_grads``; each of the window's microbatches lies in one step. With ``d_b = 1/M_b`` where step ``b`` scales its
gradients (1 where it does not), the fitted ratios ``q = w * N`` of a step-``a`` microbatch are, under each mistake:

- ``pp_scale_grads`` (torchtitan #1733): ``prod_{b > a} d_b``, the loss right for one step but every later step's
  division applied again to the gradient accumulated so far: ``1/M^(A-1-a)``, an exponential moving average;
- ``pp_last_step_only`` (NeMo Automodel #3530): 1 in the last step, 0 before it (the gradients cleared between steps);
- ``pp_divided_by_microbatches``: ``prod_{b >= a} d_b``, a loss already divided by the window's count under the
  default ``scale_grads=True`` (every weight ``1/M`` in a window of one step);
- ``count_group`` over pp: every weight ``1/pp``, the count reduced over the pp ranks too, which hold the same tokens
  (over dp x pp :func:`harness.diagnosis.count_groups.count_group` names it first; over pp alone it does not apply).

One more mistake weighs rows, not the window's microbatches: ``pp_microbatch_means`` (torchtitan PR #1732's first fix
for #1733), each schedule microbatch's loss its own token mean over ``K`` (``M x A``, the window's schedule
microbatches on its rank), averaged over the token group's ``T`` ranks: a token of schedule microbatch ``k``, which
holds ``n_k`` supervised tokens, weighs ``1/(n_k K T)``, so ``q = N / (n_k K T)``. A schedule splits its step's batch
into ``M`` chunks of rows (:func:`harness.distributed.pipeline.chunk_of`), which need not follow the window's
microbatches, so the formula is read per row (:func:`microbatch_means_reading`, on the per-sequence fit), and on the
microbatch fit only where every microbatch's rows share one predicted weight.

:func:`formula_reading` and :func:`microbatch_means_reading` are pure arithmetic on the fit's numbers
(``tests/unit/test_pipeline_diagnosis.py``); :func:`pipeline_reading` applies them to a run's fit where the microbatch
fit explains the gradient but does not read correct, :func:`pipeline_rows_reading` to its per-sequence fit.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from harness.diagnosis.evidence import Evidence
from harness.diagnosis.fit import Block, Fit, explained_residual, match_tolerance
from harness.diagnosis.row_weights import ROW_TOLERANCE
from harness.diagnosis.signatures import Signature
from harness.distributed.pipeline import ScheduleStep, chunk_of

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


class Chunk(NamedTuple):
    """Where a row lay: the token rank's step, the schedule microbatch of that step, and that chunk's supervised
    tokens (``n_k``)."""

    rank: int
    step: int
    chunk: int
    tokens: int


def chunks_of(rows: Sequence[Block], steps_by_rank: Mapping[int, Sequence[ScheduleStep]]
              ) -> dict[tuple[int, int, int], Chunk] | None:
    """The schedule microbatch of every row (``(rank, microbatch, row)`` of ``rows``, one block per row with its own
    supervised count), from the recorded steps' batch positions. None where the steps cannot say: a rank without
    steps, a step without its batch's positions, rows the window does not hold, or a supervised row in no step or in
    two."""
    tokens = {(b.rank, b.microbatch, b.row): b.tokens for b in rows if b.row is not None}
    if len(tokens) != len(rows):
        return None
    out: dict[tuple[int, int, int], Chunk] = {}
    for t in sorted({b.rank for b in rows}):
        steps = steps_by_rank.get(t)
        if not steps:
            return None
        placed: dict[tuple[int, int, int], tuple[int, int]] = {}
        counts: dict[tuple[int, int], int] = {}
        for a, s in enumerate(steps):
            if s.foreign or s.batch_rows <= 0 or len(s.at) != len(s.rows) or s.n_microbatches < 1:
                return None
            for (m, j), p in zip(s.rows, s.at, strict=True):
                key = (t, m, j)
                if key not in tokens or key in placed or not 0 <= p < s.batch_rows:
                    return None
                k = chunk_of(p, s.batch_rows, s.n_microbatches)
                placed[key] = (a, k)
                counts[(a, k)] = counts.get((a, k), 0) + tokens[key]
        for key, n in tokens.items():
            if key[0] == t and n > 0 and key not in placed:
                return None
        out.update({key: Chunk(t, a, k, counts[(a, k)]) for key, (a, k) in placed.items()})
    return out


def microbatch_means_ratios(rows: Sequence[Block], steps_by_rank: Mapping[int, Sequence[ScheduleStep]],
                            token_ranks: int) -> list[float] | None:
    """``pp_microbatch_means``'s ratio of every row: ``N / (n_k K_t T)``, ``n_k`` the supervised tokens of the
    schedule microbatch that held it, ``K_t`` the schedule microbatches of its rank's window (``sum_a M_a``), ``T``
    the token group's size; NaN for a row without a supervised token. None where :func:`chunks_of` cannot place the
    rows."""
    where = chunks_of(rows, steps_by_rank)
    n = sum(b.tokens for b in rows)
    if where is None or n == 0 or token_ranks < 1:
        return None
    per_rank = {t: sum(s.n_microbatches for s in steps) for t, steps in steps_by_rank.items()}
    out = []
    for b in rows:
        c = where.get((b.rank, b.microbatch, b.row))  # type: ignore[arg-type]
        out.append(n / (c.tokens * per_rank[b.rank] * token_ranks) if b.tokens > 0 and c is not None else math.nan)
    return out


def _means_words(rows: Sequence[Block], predicted: Sequence[float], steps_by_rank: Mapping[int, Sequence[ScheduleStep]],
                 token_ranks: int, where: Mapping[tuple[int, int, int], Chunk], view: str) -> str:
    n = sum(b.tokens for b in rows)
    ks = sorted({sum(s.n_microbatches for s in steps) for steps in steps_by_rank.values()})
    a_steps = sorted({len(steps) for steps in steps_by_rank.values()})
    by_chunk: dict[Chunk, float] = {}
    for b, p in zip(rows, predicted, strict=True):
        c = where.get((b.rank, b.microbatch, b.row))  # type: ignore[arg-type]
        if c is not None and b.tokens > 0:
            by_chunk[c] = p
    hi = max(by_chunk, key=by_chunk.__getitem__)
    lo = min(by_chunk, key=by_chunk.__getitem__)
    who = {b.rank: b.holder or f"rank {b.rank}" for b in rows}
    k_words = "/".join(map(str, ks))
    over = f", averaged over the token group's {token_ranks} ranks" if token_ranks > 1 else ""
    return (f"each schedule microbatch's loss was its own token mean, divided by the window's K = M x A = {k_words} "
            f"schedule microbatches{over}: a mean of the {len(by_chunk)} schedule microbatches' means over "
            f"{'/'.join(map(str, a_steps))} steps, where the window's token mean belongs (torchtitan #1732's first "
            f"fix): a token of schedule microbatch k weighs 1/(n_k x K x T); {who[hi.rank]}'s step {hi.step}, "
            f"microbatch {hi.chunk} (n_k={hi.tokens} of N={n}) weighs {by_chunk[hi]:.3g}x, {who[lo.rank]}'s step "
            f"{lo.step}, microbatch {lo.chunk} (n_k={lo.tokens}) {by_chunk[lo]:.3g}x; divide each microbatch's loss "
            f"sum by the window's count over the token group instead ({view})")


def microbatch_means_reading(rows: Sequence[Block], q: Sequence[float],
                             steps_by_rank: Mapping[int, Sequence[ScheduleStep]], token_ranks: int,
                             tolerance: float = ROW_TOLERANCE) -> Signature | None:
    """``pp_microbatch_means`` where the rows' fitted ratios ``q`` (one per row, ``w * N``) are
    :func:`microbatch_means_ratios` within ``tolerance`` relative to the largest; None where the rows cannot be
    placed, where the formula predicts the right weights (every schedule microbatch as full), or where it misses."""
    predicted = microbatch_means_ratios(rows, steps_by_rank, token_ranks)
    if predicted is None:
        return None
    live = [(v, p) for b, v, p in zip(rows, q, predicted, strict=True) if b.tokens > 0 and math.isfinite(p)]
    if not live or any(not math.isfinite(v) for v, _ in live):
        return None
    top = max(abs(p) for _, p in live)
    if all(abs(p - 1) <= tolerance for _, p in live):
        return None
    if max(abs(v - p) for v, p in live) > tolerance * top:
        return None
    where = chunks_of(rows, steps_by_rank) or {}
    return Signature("pp_microbatch_means", _means_words(rows, predicted, steps_by_rank, token_ranks, where,
                                                          "read per row"))


def _steps_by_rank(ev: Evidence, window: int, ranks: set[int]) -> dict[int, Sequence[ScheduleStep]] | None:
    assert ev.records is not None
    out: dict[int, Sequence[ScheduleStep]] = {}
    for t in ranks:
        records = ev.records[ev.mesh.holder(t)]
        if window >= len(records) or not records[window].pipeline_steps:
            return None
        out[t] = records[window].pipeline_steps
    return out


def _rows_of_blocks(ev: Evidence, window: int, blocks: Sequence[Block]) -> list[Block]:
    """One block per row of every block's microbatch (its own supervised count), as the per-sequence fit's."""
    out: list[Block] = []
    for b in blocks:
        mb = ev.windows[window][b.rank][b.microbatch]
        out.extend(Block(b.rank, b.microbatch, mb.row(i).supervised, row=i, holder=b.holder)
                   for i in range(mb.inputs.shape[0]))
    return out


def block_means_reading(blocks: Sequence[Block], q: Sequence[float], rows: Sequence[Block],
                        steps_by_rank: Mapping[int, Sequence[ScheduleStep]], token_ranks: int) -> Signature | None:
    """``pp_microbatch_means`` read on the microbatch fit's ratios ``q`` (one per block of ``blocks``), ``rows`` the
    blocks' rows (one block per row): only where every block's supervised rows share one predicted ratio (the
    schedule microbatches holding them as full as each other), else None, and the per-sequence fit reads it."""
    predicted = microbatch_means_ratios(rows, steps_by_rank, token_ranks)
    if predicted is None:
        return None
    per_block: dict[tuple[int, int], list[float]] = {}
    for r, p in zip(rows, predicted, strict=True):
        if r.tokens > 0:
            per_block.setdefault((r.rank, r.microbatch), []).append(p)
    live = []
    for b, v in zip(blocks, q, strict=True):
        if b.tokens <= 0:
            continue
        ps = per_block.get((b.rank, b.microbatch))
        if not ps or max(ps) - min(ps) > 1e-12 * max(ps) or not math.isfinite(v):
            return None
        live.append((v, ps[0]))
    if not live or all(abs(p - 1) <= match_tolerance() for _, p in live):
        return None
    top = max(abs(p) for _, p in live)
    if max(abs(v - p) for v, p in live) > match_tolerance() * top:
        return None
    where = chunks_of(rows, steps_by_rank) or {}
    return Signature("pp_microbatch_means", _means_words(rows, predicted, steps_by_rank, token_ranks, where,
                                                          "each microbatch's rows in equally full chunks"))


def pipeline_reading(ev: Evidence, window: int, blocks: Sequence[Block], fit: Fit, sig: Signature) -> Signature:
    """``sig``, or on a mesh with pp where the microbatch fit explains the gradient and reads neither correct nor a
    stronger reading (:data:`LEFT_AS_READ`), the mistake whose formula over the recorded steps gives its weights."""
    pp = ev.mesh.size("pp")
    if pp < 2 or ev.records is None or sig.name in LEFT_AS_READ or fit.residual > explained_residual():
        return sig
    n = sum(b.tokens for b in blocks)
    steps_by_rank = _steps_by_rank(ev, window, {b.rank for b in blocks})
    if steps_by_rank is None:
        return sig
    q = [float(w) * n for w in fit.weights]
    found = formula_reading(blocks, q, steps_by_rank, pp)
    if found is None and ev.mesh.size("cp") == 1:
        rows = _rows_of_blocks(ev, window, blocks)
        found = block_means_reading(blocks, q, rows, steps_by_rank, ev.mesh.token_ranks)
    return sig if found is None else found


def pipeline_rows_reading(ev: Evidence, window: int, rows: Sequence[Block], fit: Fit) -> Signature | None:
    """On a mesh with pp, ``pp_microbatch_means`` read on the per-sequence fit (``rows``: one block per row, its
    ``rank`` the token rank); None elsewhere, where that fit leaves a residual, or where the formula misses."""
    if ev.mesh.size("pp") < 2 or ev.mesh.size("cp") > 1 or ev.records is None:
        return None
    if fit.residual > explained_residual():
        return None
    steps_by_rank = _steps_by_rank(ev, window, {b.rank for b in rows})
    if steps_by_rank is None:
        return None
    n = sum(b.tokens for b in rows)
    return microbatch_means_reading(rows, [float(w) * n for w in fit.weights], steps_by_rank, ev.mesh.token_ranks)


__all__ = ["LEFT_AS_READ", "Chunk", "block_means_reading", "chunks_of", "formula_reading", "microbatch_means_ratios",
           "microbatch_means_reading", "pipeline_reading", "pipeline_rows_reading", "step_of"]
