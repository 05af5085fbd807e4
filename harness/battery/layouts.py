"""Drawn layouts: windows of any shape for the battery's property lane (``test_drawn_layouts.py``).

A :class:`Layout` is plain data (world size, windows of microbatches of rows given as ``(length, prompt)``, the seeds
of the tokens and of the initial weights), so a failing one prints as text that rebuilds it. :func:`layouts` draws them
with Hypothesis (a test-only dependency, imported only there); :func:`shrink` makes a failing layout smaller with a
bounded number of launches, because every example costs a multi-rank run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

import harness.battery.judge.checks  # noqa: F401  (the checks register themselves in REGISTRY when imported)
from harness.battery.judge import registry
from harness.battery.judge.verdict import FAIL, NOT_APPLICABLE, PASS, Verdict
from harness.battery.judge.witness import keeps_reading, reading_key, shrunk_note, witness
from harness.battery.launch import runner
from harness.battery.plan.options import WORLD_SIZES, BatteryOptions, RunSpec
from harness.battery.prepare.probe.facts import ModelFacts
from harness.battery.scenarios import BATTERY_CONFIG, MAX_WORLD_SIZE, Windows
from harness.core.mesh import Mesh
from harness.core.microbatch import Microbatch
from harness.data.batching import collate
from harness.data.corpus import Row

RowShape = tuple[int, int]
"""``(length, prompt)``: a sequence of ``length`` tokens whose first ``prompt`` are never a target
(``prompt == length``: no supervised token)."""

MAX_MICROBATCHES = 6
MAX_WINDOWS = 2
MAX_ROWS = 3
SHORTEST_ROW = 2
"""The fewest tokens of a drawn row (one input position and its target)."""


@dataclass(frozen=True)
class Layout:
    world_size: int
    windows: tuple[tuple[tuple[tuple[RowShape, ...], ...], ...], ...]
    """``windows[k][rank][microbatch]`` -> the rows' shapes."""
    data_seed: int = 0
    init_seed: int = 0
    factor_seed: int = 0
    """The seed of the per-token factors the declared objective needs (weights with zeros, advantages)."""

    def build(self) -> Windows:
        """The microbatches: random tokens from ``data_seed``, each row padded and masked as the corpus's are."""
        gen = torch.Generator().manual_seed(self.data_seed)
        vocab = BATTERY_CONFIG.vocab_size
        out: Windows = []
        for window in self.windows:
            ranks = []
            for rank in window:
                mbs: list[Microbatch] = []
                for rows in rank:
                    made = [Row(-1, "drawn", tuple(int(t) for t in torch.randint(1, vocab, (n,), generator=gen)), p)
                            for n, p in rows]
                    mbs.append(collate(made))
                ranks.append(mbs)
            out.append(ranks)
        return out

    def windows_for(self, spec: RunSpec) -> Windows:
        """:meth:`build`, with the factors ``spec``'s objective needs drawn from ``factor_seed`` (the same layout, other
        weights or advantages, is another example)."""
        from harness.battery.prepare.objective import resolve
        from harness.core.objectives import with_factors

        windows = self.build()
        objective = resolve(spec.objective, spec.recipe)
        return windows if objective.weights is None else with_factors(windows, objective.weights, self.factor_seed)

    def counts(self) -> list[list[list[int]]]:
        """Supervised tokens per window, rank and microbatch."""
        return [[[sum(n - max(p, 1) for n, p in rows) for rows in rank] for rank in window] for window in self.windows]

    def describe(self) -> str:
        lines = [f"Layout(world_size={self.world_size}, data_seed={self.data_seed}, init_seed={self.init_seed}, "
                 f"factor_seed={self.factor_seed}): supervised tokens per microbatch"]
        for k, window in enumerate(self.counts()):
            ranks = "; ".join(f"rank {r} {mbs}" for r, mbs in enumerate(window))
            lines.append(f"  window {k}: {ranks}")
        return "\n".join(lines)


def _with_tokens(window: list[list[list[RowShape]]]) -> list[list[list[RowShape]]]:
    """A window whose ranks hold no supervised token at all gets one in rank 0's first row (the empty window is the
    battery's all_empty scenario, not this lane's)."""
    if any(n - max(p, 1) > 0 for rank in window for rows in rank for n, p in rows):
        return window
    n, _ = window[0][0][0]
    window[0][0][0] = (n, 0)
    return window


def fits(layout: Layout, facts: ModelFacts | None) -> bool:
    """Whether every microbatch of ``layout`` is a shape the model runs (:meth:`ModelFacts.allows`; rows of ``n``
    tokens feed ``n - 1`` positions, the microbatch pads to its longest row)."""
    if facts is None:
        return True
    return all(facts.allows(len(rows), max(n for n, _ in rows) - 1)
               for window in layout.windows for rank in window for rows in rank)


def _fit_rows(rows: list[RowShape], facts: ModelFacts | None) -> list[RowShape]:
    """The drawn rows, made into a shape the model runs: no row longer than it takes, and the first row long
    enough that ``rows x positions`` reaches its minimum (a one-row, one-token microbatch under BatchNorm)."""
    if facts is None:
        return rows
    if facts.max_len is not None:
        rows = [(min(n, facts.max_len + 1), min(p, facts.max_len + 1)) for n, p in rows]
    need = -(-facts.min_positions // len(rows)) + 1  # ceil(min / rows) positions, + 1 token
    longest = max(n for n, _ in rows)
    if longest < need:
        n, p = rows[0]
        rows[0] = (need, p if p < n else need)  # a row without a target stays without one
    return rows


def layouts(max_world_size: int = MAX_WORLD_SIZE, max_microbatches: int = MAX_MICROBATCHES,
            max_windows: int = MAX_WINDOWS, facts: ModelFacts | None = None,
            world_sizes: Sequence[int] | None = None) -> Any:
    """A Hypothesis strategy of layouts: world size 1..4 (drawn from ``world_sizes`` when given: the battery's
    ``--world-sizes``), 1..6 microbatches per window (the same on every rank, as the contract says), 1..3 rows of
    2..max_len tokens with prompt prefixes, microbatches and whole ranks without any supervised token, and the seeds of
    tokens and initial weights."""
    from hypothesis import strategies as st

    max_len, prompt_max = BATTERY_CONFIG.max_len, BATTERY_CONFIG.prompt_max

    @st.composite
    def draw_layout(draw: Callable[[Any], Any]) -> Layout:
        world = draw(st.sampled_from(sorted(set(world_sizes))) if world_sizes else st.integers(1, max_world_size))
        windows = []
        for _ in range(draw(st.integers(1, max_windows))):
            n_mb = draw(st.integers(1, max_microbatches))
            empty_rank = draw(st.one_of(st.none(), st.integers(0, world - 1))) if world > 1 else None
            window = []
            for rank in range(world):
                mbs = []
                for _ in range(n_mb):
                    empty = rank == empty_rank or draw(st.integers(0, 5)) == 0
                    rows = draw(st.lists(st.tuples(st.integers(SHORTEST_ROW, max_len), st.integers(0, prompt_max)),
                                         min_size=1, max_size=MAX_ROWS))
                    mbs.append(_fit_rows([(n, n if empty else min(p, n - 1)) for n, p in rows], facts))
                window.append(mbs)
            windows.append(_with_tokens(window))
        frozen = tuple(tuple(tuple(tuple(rows) for rows in rank) for rank in w) for w in windows)
        return Layout(world, frozen, draw(st.integers(0, 2**16)), draw(st.integers(0, 2**16)),
                      draw(st.integers(0, 2**16)))

    return draw_layout()


def _candidates(layout: Layout) -> list[Layout]:
    """Smaller layouts, most reducing first: fewer windows, fewer ranks, fewer microbatches, one row each."""
    ws = [[[list(rows) for rows in rank] for rank in w] for w in layout.windows]
    out = []

    def make(windows: list[list[list[list[RowShape]]]], world: int | None = None) -> None:
        if not windows or any(not rank for w in windows for rank in w):
            return
        fixed = [_with_tokens(w) for w in windows]
        frozen = tuple(tuple(tuple(tuple(rows) for rows in rank) for rank in w) for w in fixed)
        out.append(dataclasses.replace(layout, world_size=world or layout.world_size, windows=frozen))

    if len(ws) > 1:
        for k in range(len(ws)):
            make([w for j, w in enumerate(ws) if j != k])
    if layout.world_size > 1:
        make([w[:-1] for w in ws], layout.world_size - 1)
    for k, w in enumerate(ws):
        for m in range(len(w[0])):
            if len(w[0]) > 1:
                make([[[rows for i, rows in enumerate(rank) if i != m] for rank in ww] if j == k else ww
                      for j, ww in enumerate(ws)])
    if any(len(rows) > 1 for w in ws for rank in w for rows in rank):
        make([[[rows[:1] for rows in rank] for rank in w] for w in ws])
    return out


def shrink(layout: Layout, fails: Callable[[Layout], bool], budget: int = 10,
           facts: ModelFacts | None = None, world_sizes: Sequence[int] | None = None) -> tuple[Layout, int]:
    """Greedily replace ``layout`` by a smaller one that still ``fails``, trying at most ``budget`` candidates
    (each is a launch) among the shapes the model runs (``facts``) and the ``world_sizes`` allowed; returns the
    smallest found and the number of launches spent."""
    spent = 0
    improved = True
    while improved and spent < budget:
        improved = False
        for candidate in (c for c in _candidates(layout)
                          if fits(c, facts) and (not world_sizes or c.world_size in world_sizes)):
            if spent >= budget:
                break
            spent += 1
            if fails(candidate):
                layout, improved = candidate, True
                break
    return layout, spent


DRAWN_CHECKS = tuple(name for name, info in registry.REGISTRY.items() if info.runs_on("drawn"))
"""What every drawn layout is checked for: every registered check that runs on a window with supervised tokens
(parity, one synchronization, ranks agree, the logged loss, hygiene, clipping, weights unchanged; a check that does
not apply, such as clipping for a recipe that does not clip or one_sync at W=1, is n/a there). A drawn layout always
holds a token (:func:`_with_tokens`), so the empty-window check is the all_empty scenario's."""


def informative_layouts(world_sizes: Sequence[int] | None = None, facts: ModelFacts | None = None) -> list[Layout]:
    """The layouts the drawn lane checks first, before any drawn one: shapes on which the usual mistakes read apart.

    Hypothesis's first example is its simplest (one rank or two, one microbatch, one row, one supervised token),
    where a mean of local means, a missing world-size factor and a per-microbatch mean give the same gradient and
    the diagnosis cannot tell them apart. These hold the largest chosen world size (then the next one), ranks whose
    supervised counts all differ, three microbatches per rank whose counts differ too, prompts on some rows, and
    (the second) a microbatch without any supervised token and a second window of two microbatches."""
    worlds = sorted(set(world_sizes or WORLD_SIZES), reverse=True)
    seconds = [w for w in worlds[1:] if w > 1] or worlds[:1]

    def rank_rows(rank: int, micro: int, shift: int) -> list[RowShape]:
        # Row r of microbatch m on rank p: lengths that grow with p and m (no two ranks, no two microbatches of a rank
        # hold one count), one or two rows, a prompt on every other microbatch.
        rows = 1 + (rank + micro + shift) % 2
        return [(6 + 5 * rank + 3 * micro + 2 * r + shift, 2 if (micro + r) % 2 else 0) for r in range(rows)]

    def make(world: int, shape: Sequence[int], shift: int, empty: tuple[int, int] | None, seed: int) -> Layout:
        windows = []
        for k, n_mb in enumerate(shape):
            window = [[_fit_rows(rank_rows(rank, m, shift + k), facts) for m in range(n_mb)] for rank in range(world)]
            if k == 0 and empty is not None and empty[0] < world:
                rank, m = empty
                window[rank][m] = [(n, n) for n, _ in window[rank][m]]  # every position a prompt: no target
            windows.append(_with_tokens(window))
        frozen = tuple(tuple(tuple(tuple(rows) for rows in rank) for rank in w) for w in windows)
        return Layout(world, frozen, data_seed=seed, init_seed=seed + 1, factor_seed=seed + 2)

    return [make(worlds[0], (3,), 0, None, 11), make(seconds[0], (3, 2), 1, (seconds[0] - 1, 1), 23)]


def judge_layout(recipe: str, layout: Layout, options: BatteryOptions, precision: str = "fp32",
                 strategy: str | None = None, mesh: Mesh | None = None) -> list[Verdict]:
    """Every drawn check's verdict (:data:`DRAWN_CHECKS`) for ``recipe`` on ``layout`` in ``precision`` under
    ``strategy`` (default: the session's first), under ``options`` (the model, batch format, find_unused policy,
    objective and each launch's deadline); over ``mesh``, the layout's ranks are its data ranks."""
    world = layout.world_size if mesh is None else mesh.world_size
    spec = replace(options.spec(recipe, "drawn", world, precision, strategy=strategy, mesh=mesh),
                   init_seed=layout.init_seed)
    run = runner.launch_run(spec, layout.windows_for(spec))
    return [registry.CHECKS[c](run) for c in DRAWN_CHECKS]


def _failing(verdicts: list[Verdict]) -> list[Verdict]:
    return [v for v in verdicts if v.status == FAIL]


class _LayoutFailed(AssertionError):
    def __init__(self, layout: Layout, verdicts: list[Verdict]) -> None:
        self.layout = layout
        self.verdicts = verdicts
        super().__init__("\n".join(v.message for v in verdicts))


def lane_label(examples: int, world_sizes: Sequence[int], precision: str, strategy: str,
               mesh: Mesh | None = None) -> str:
    """The drawn lane's row in the table: its budget, world sizes (or mesh), precision lane and strategy."""
    where = f"W in {','.join(map(str, sorted(world_sizes)))}" if mesh is None else f"mesh {mesh.label}"
    return f"drawn ({examples} layouts, {where}, {precision}, {strategy})"


def drawn_verdicts(recipe: str, options: BatteryOptions | None = None, derandomize: bool = False) -> list[Verdict]:
    """:func:`drawn_verdict` in every precision lane and strategy of ``options``
    (:func:`harness.battery.plan.cases.drawn_lanes`): one verdict, one table row, each."""
    from harness.battery.plan.cases import drawn_lanes

    options = options or BatteryOptions()
    return [drawn_verdict(recipe, options, derandomize, precision=lane.precision, strategy=lane.strategy,
                          examples=lane.examples, mesh=lane.mesh) for lane in drawn_lanes(options)]


def drawn_verdict(recipe: str, options: BatteryOptions | None = None, derandomize: bool = False, *,
                  precision: str | None = None, strategy: str | None = None,
                  examples: int | None = None, mesh: Mesh | None = None) -> Verdict:
    """Check ``recipe`` on ``examples`` layouts (default ``options.examples``: the first
    :func:`informative_layouts`, then drawn ones; at the world sizes of ``options``, the shrunk layout's included;
    default :class:`~harness.battery.plan.options.BatteryOptions`) in ``precision`` under ``strategy`` (default: the
    session's first lane and strategy); one verdict, whose failure message shows the failing layout with the failing
    checks' messages and diagnosis, then a shrunk layout that still fails. Needs Hypothesis.

    In the bf16 lane each layout is judged as the bf16 scenarios are (:mod:`harness.battery.prepare.bf16`: the bound
    derived from the correct computation's own noise on that layout, its windows too balanced to judge refused); the
    verdict says on how many layouts parity could be judged, and is n/a when on none.

    The verdict is one row of the battery's table whether it passes or fails: ``world_size`` 0 (several), and
    ``label`` "drawn (12 layouts, W in 1,2,3,4, fp32, ddp)"; a failure's message names the failing layout's world
    size. Over ``mesh``, each layout's ranks are the mesh's data ranks (every layout at ``mesh.data_ranks``).
    """
    import hypothesis

    options = options or BatteryOptions()
    precision = precision or options.lanes[0]
    strategy = strategy or options.strategy_lanes[0]
    examples = options.examples if examples is None else examples
    worlds = options.world_sizes if mesh is None else (mesh.data_ranks,)
    if examples < 1:
        msg = f"--battery-examples={examples!r} must be a positive number of drawn layouts here"
        raise ValueError(msg)
    label = lane_label(examples, worlds, precision, strategy, mesh)

    facts: ModelFacts | None = None
    if options.model is not None:
        from harness.battery.prepare.probe.facts import probe_model
        from harness.battery.spec import ModelSpec

        facts = probe_model(ModelSpec(options.model, options.batch_format))
    parity_judged = [0]
    seen: list[Layout] = []
    unjudged: list[str] = []  # why each layout's checks were all n/a (the model refused the lane, say)

    def check(layout: Layout) -> None:
        verdicts = judge_layout(recipe, layout, options, precision, strategy, mesh)
        seen.append(layout)
        parity_judged[0] += any(v.check == "parity" and v.status == PASS for v in verdicts)
        if verdicts and all(v.status == NOT_APPLICABLE and registry.MODEL_REFUSED in v.message for v in verdicts):
            unjudged.append(verdicts[0].message)
        failed = _failing(verdicts)
        if failed:
            raise _LayoutFailed(layout, failed)

    first = [lay for lay in informative_layouts(worlds, facts) if fits(lay, facts)][:examples]

    @hypothesis.settings(max_examples=max(examples - len(first), 1), deadline=None, derandomize=derandomize,
                         database=None, print_blob=True,
                         phases=(hypothesis.Phase.explicit, hypothesis.Phase.generate),
                         suppress_health_check=list(hypothesis.HealthCheck))
    @hypothesis.given(layout=layouts(facts=facts, world_sizes=worlds))
    def every_layout(layout: Layout) -> None:
        check(layout)

    judged: dict[Layout, list[Verdict]] = {}

    def failing_on(layout: Layout) -> list[Verdict]:
        if layout not in judged:
            judged[layout] = _failing(judge_layout(recipe, layout, options, precision, strategy, mesh))
        return judged[layout]

    try:
        for layout in first:
            check(layout)
        if examples > len(first):
            every_layout()
    except _LayoutFailed as exc:
        at = (f"W={exc.layout.world_size}" if mesh is None else
              f"W={mesh.world_size} (mesh {mesh.label}, {exc.layout.world_size} data ranks)")
        failing = ", ".join(sorted({v.check for v in exc.verdicts}))
        head = (f"check drawn FAILED: recipe {recipe}, {precision}, {strategy}: a drawn layout at {at} fails "
                f"{failing}:\n"
                f"{exc.layout.describe()}\n" + "\n".join(v.message for v in exc.verdicts) + "\n")
        if all(v.cause == "deadline" for v in exc.verdicts):
            # Every smaller layout would cost a whole deadline too, and the size of a layout is rarely the reason.
            message = head + "not shrunk (the run hit its deadline)"
        else:
            # A candidate is taken only where it fails with the failing layout's own reading (keeps_reading): one
            # that still fails but reads otherwise (one row per microbatch makes a mean per microbatch the sequence
            # mean; a lone rank makes a missing W a mean of local means) is a worse witness, of a mistake its counts
            # cannot name, and the smallest layout is worth showing only as a witness of the mistake the verdict
            # reports.
            want = reading_key(witness(exc.verdicts))
            small, spent = shrink(exc.layout, lambda lay: keeps_reading(want, failing_on(lay)), facts=facts,
                                  world_sizes=worlds)
            if small == exc.layout:
                message = head + f"not shrunk: no smaller layout fails with the same reading ({spent} launches)"
            else:
                shown = failing_on(small) or exc.verdicts
                message = head + f"shrunk ({spent} launches) to:\n{small.describe()}\n" + "\n".join(
                    v.message for v in shown)
                note = shrunk_note(witness(exc.verdicts), witness(shown))
                message += f"\n{note}" if note else ""
        # The diagnosis and its fix are read on the failing layout itself: a shrunk one (one rank's single token, say)
        # can make several mistakes give one gradient.
        read = witness(exc.verdicts)
        return Verdict("drawn", recipe, "drawn", 0, precision, FAIL, message, cause=exc.verdicts[0].cause,
                       details=exc.verdicts[0].details, diagnosis=read.diagnosis, finding=read.finding, label=label,
                       strategy=strategy, fix=read.fix)
    how = "derandomized" if derandomize else "random"
    said = (f"check drawn passed: recipe {recipe}, {precision}, {strategy}: {examples} layouts ({len(first)} chosen to "
            f"tell mistakes apart, the rest drawn, {how}; W in {','.join(map(str, sorted(worlds)))}) pass every "
            f"check that applies ({', '.join(DRAWN_CHECKS)})")
    if seen and len(unjudged) == len(seen):
        return Verdict("drawn", recipe, "drawn", 0, precision, NOT_APPLICABLE, f"check drawn not applicable: recipe "
                       f"{recipe}, {precision}, {strategy}: no check applies on any of the {len(seen)} layouts; the "
                       f"first's: {unjudged[0]}", label=label, strategy=strategy)
    if precision == "bf16":
        if parity_judged[0] == 0:
            return Verdict("drawn", recipe, "drawn", 0, precision, NOT_APPLICABLE, said.replace(
                "check drawn passed", "check drawn not applicable") + "; but parity could be judged on none of them "
                "in bf16: every window too balanced for a weighting mistake to stand above the noise's bound",
                label=label, strategy=strategy)
        said += f"; parity judged in bf16 on {parity_judged[0]} of them" + (
            " (the others too balanced for a weighting mistake to stand above the bound derived from their noise)"
            if parity_judged[0] < examples else "")
    return Verdict("drawn", recipe, "drawn", 0, precision, PASS, said, label=label, strategy=strategy)
