"""The pipeline split (:mod:`harness.distributed.pipeline`): stage modules that hold the full model's own parameters
under their own names, each in exactly one stage, whose composition is the model; the refusals; and a window's
microbatches as one schedule step's batch."""

from __future__ import annotations

import re
import sys
import types
from typing import Any

import pytest
import torch
from torch import nn

from harness.battery import scenarios
from harness.battery.prepare.probe.facts import probe_meshes
from harness.core.loss import loss_sum
from harness.core.mesh import PP_SCHEDULES, Mesh
from harness.core.microbatch import Microbatch
from harness.distributed import pipeline
from harness.model import ModelError, build_model

G = torch.Generator().manual_seed(0)
"""The tests' draws: the global generator stays untouched (tests/conftest.py checks)."""


def _model() -> nn.Module:
    return build_model(scenarios.BATTERY_CONFIG)


@pytest.mark.parametrize("n_stages", [2, 3])
def test_the_builtin_split_keeps_every_name_and_holds_each_parameter_once(n_stages: int) -> None:
    model = _model()
    stages = pipeline.builtin_split(model, n_stages)
    named = dict(model.named_parameters())
    seen = [name for stage in stages for name, _ in stage.named_parameters()]
    assert sorted(seen) == sorted(named)  # every parameter once, under the full model's name
    for stage in stages:
        for name, p in stage.named_parameters():
            assert p is named[name]  # the model's own tensor, not a copy
    pipeline.check_split(model, stages)


def test_the_stages_in_order_compute_the_models_logits() -> None:
    model = _model()
    ids = torch.randint(1, 10, (3, 7), generator=G)
    x = ids
    for stage in pipeline.builtin_split(model, 2):
        x = stage(x)
    torch.testing.assert_close(x, model(ids), rtol=0, atol=0)


def test_split_points_choose_where_stages_start_and_bad_ones_are_refused() -> None:
    model = _model()
    assert [["tok"], ["blocks.0", "ln", "head"]] == pipeline.cut(pipeline.builtin_units(model), 2, ["blocks.0"])
    assert [["tok", "blocks.0"], ["ln", "head"]] == pipeline.cut(pipeline.builtin_units(model), 2)
    with pytest.raises(ValueError, match=re.escape("must name 1 of the units tok, blocks.0, ln, head")):
        pipeline.cut(pipeline.builtin_units(model), 2, ["blocks.7"])


def test_the_one_block_model_cuts_into_the_four_stages_of_pp2_interleaved() -> None:
    """The norm and the head are units of their own, so pp=2 with 2 stages per rank has a unit per stage, and the
    four stages in order still compute the model's logits."""
    model = _model()
    n = 2 * pipeline.stages_per_rank("interleaved1f1b")
    assert [["tok"], ["blocks.0"], ["ln"], ["head"]] == pipeline.cut(pipeline.builtin_units(model), n)
    ids = torch.randint(1, 10, (2, 6), generator=G)
    x = ids
    for stage in pipeline.builtin_split(model, n):
        x = stage(x)
    torch.testing.assert_close(x, model(ids), rtol=0, atol=0)


@pytest.mark.parametrize(("schedule", "per_rank"), [("gpipe", 1), ("1f1b", 1), ("interleaved1f1b", 2),
                                                    ("loopedbfs", 2), ("interleavedzb", 2)])
def test_the_interleaved_schedules_hold_two_stages_per_rank(schedule: str, per_rank: int) -> None:
    assert per_rank == pipeline.stages_per_rank(schedule)


def test_looped_placement_gives_rank_r_the_stages_r_and_r_plus_pp() -> None:
    """torch's interleaved schedules compute their order for stage s on rank s % pp: with pp=2 and 2 stages per
    rank, rank 0 holds stages 0 and 2, rank 1 stages 1 and 3; every stage is held once."""
    assert [0, 2] == pipeline.local_stages(0, 2, 2)
    assert [1, 3] == pipeline.local_stages(1, 2, 2)
    assert [[0, 3, 6], [1, 4, 7], [2, 5, 8]] == [pipeline.local_stages(r, 3, 3) for r in range(3)]
    assert [1] == pipeline.local_stages(1, 2, 1)  # one stage per rank: the rank's own
    held = sorted(s for r in range(4) for s in pipeline.local_stages(r, 4, 2))
    assert list(range(8)) == held


def test_too_few_units_for_pp_times_the_stages_per_rank_are_refused_naming_both() -> None:
    """Four units cannot make the six stages of pp=3 interleaved: the error names pp*2 and the pp that fits."""
    model = _model()
    n = 3 * pipeline.stages_per_rank("interleaved1f1b")
    with pytest.raises(ValueError, match=re.escape("6 pipeline stages (pp, or pp*2 under an interleaved schedule) "
                                                   "but the model has 4 units")) as refused:
        pipeline.builtin_split(model, n)
    assert "pp <= 2 with an interleaved schedule" in str(refused.value)
    assert 4 == len(pipeline.builtin_split(model, 4))  # its control: four stages fit the four units


def test_a_split_that_drops_or_repeats_a_parameter_is_refused() -> None:
    """Its negative control: ``check_split`` rejects a stage list missing the head, and one holding it twice."""
    model = _model()
    stages = pipeline.builtin_split(model, 2)
    with pytest.raises(ValueError, match=re.escape("missing: ['head.weight'")):
        pipeline.check_split(model, [*stages[:1], stages[1].ln])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="in several stages"):
        pipeline.check_split(model, [*stages, stages[1]])


def test_a_sequential_models_split_points_name_its_children() -> None:
    with torch.random.fork_rng(devices=[]):
        model = nn.Sequential()
        model.add_module("embed", nn.Embedding(10, 4))
        model.add_module("mid", nn.Linear(4, 4))
        model.add_module("out", nn.Linear(4, 10))

    def factory() -> nn.Module:
        return model

    factory.pp_split = ["out"]  # type: ignore[attr-defined]
    module = types.ModuleType("pp_split_probe")
    module.factory = factory  # type: ignore[attr-defined]
    sys.modules["pp_split_probe"] = module
    try:
        stages = pipeline.split_of("pp_split_probe:factory")(model, 2)
    finally:
        del sys.modules["pp_split_probe"]
    assert [["embed.weight", "mid.weight", "mid.bias"], ["out.weight", "out.bias"]] == [
        [n for n, _ in s.named_parameters()] for s in stages]
    ids = torch.randint(0, 10, (2, 3), generator=G)
    torch.testing.assert_close(stages[1](stages[0](ids)), model(ids), rtol=0, atol=0)


def test_a_window_becomes_one_steps_batch_with_the_same_loss_sum() -> None:
    """Rows stacked, padded on the right and to a multiple of the microbatch count; the padding supervises nothing,
    so the loss sum (and the count) is the window's."""
    model = _model()
    a = Microbatch(torch.randint(1, 10, (2, 5), generator=G), torch.randint(1, 10, (2, 5), generator=G))
    b = Microbatch(torch.randint(1, 10, (1, 8), generator=G), torch.randint(1, 10, (1, 8), generator=G))
    inputs, labels = pipeline.Pipeline.batch([a, b], 2)
    assert (4, 8) == tuple(inputs.shape)
    assert int((labels != -100).sum()) == a.supervised + b.supervised
    whole = loss_sum(model(inputs), labels)
    torch.testing.assert_close(whole, loss_sum(model(a.inputs), a.labels) + loss_sum(model(b.inputs), b.labels))


def test_every_schedule_name_is_a_torch_schedule() -> None:
    from torch.distributed import pipelining

    assert tuple(pipeline.SCHEDULE_CLASSES) == PP_SCHEDULES
    for cls in pipeline.SCHEDULE_CLASSES.values():
        assert hasattr(pipelining, cls), cls


class _Gapped(nn.Module):
    """Children applied in order, but with a function between two of them: a split by points loses it."""

    def __init__(self, gap: bool, vocab: int = 8) -> None:
        super().__init__()
        self.gap = gap
        self.emb = nn.Embedding(vocab, 4)
        self.head = nn.Linear(4, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        return self.head(torch.tanh(h) if self.gap else h)


@pytest.mark.parametrize("gap", [False, True])
def test_a_split_whose_stages_lose_part_of_the_forward_is_refused(gap: bool) -> None:
    """The stages of a split by points must compute the model's own output; a function called between two children
    is lost, and the split is refused naming it. Its control: the same model without the function passes."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = _Gapped(gap)
    stages = [pipeline.SequentialStage(model, ["emb"]), pipeline.SequentialStage(model, ["head"])]
    ids = torch.tensor([[1, 2, 3]])
    if not gap:
        pipeline.check_composes(model, stages, ids)
        return
    with pytest.raises(ValueError, match="the stages applied in order do not give the model's own output"):
        pipeline.check_composes(model, stages, ids)


def _gapped_factory(gap: bool) -> Any:
    def factory() -> nn.Module:
        return _Gapped(gap, scenarios.BATTERY_CONFIG.vocab_size)

    factory.pp_split = ["head"]  # type: ignore[attr-defined]
    return factory


@pytest.mark.parametrize("gap", [False, True])
def test_a_model_whose_split_cannot_run_is_refused_once_before_any_rank_starts(gap: bool) -> None:
    """:func:`harness.battery.prepare.probe.facts.probe_meshes` (what the pytest plugin and the command line call
    before the first case) refuses a split that loses part of the forward as a usage error naming the model and the pp
    size; the same model without the function between its children passes, and a mesh without pp asks nothing of the
    split."""
    name = f"pp_gap_probe_{gap}:factory"  # a module of its own per case: factories are loaded once per path
    module = types.ModuleType(name.split(":")[0])
    module.factory = _gapped_factory(gap)  # type: ignore[attr-defined]
    sys.modules[module.__name__] = module
    try:
        probe_meshes(name, [Mesh.parse("dp=2")])
        if not gap:
            probe_meshes(name, [Mesh.parse("pp=2"), Mesh.parse("dp=2,pp=2")])
            return
        with pytest.raises(ModelError, match=r"model='pp_gap_probe_True:factory' over a mesh with pp=2: its pipeline "
                                             r"split: the stages applied in order do not give"):
            probe_meshes(name, [Mesh.parse("dp=2"), Mesh.parse("pp=2")])
    finally:
        del sys.modules[module.__name__]


def test_the_builtin_model_over_more_stages_than_units_is_refused_up_front() -> None:
    """The built-in model has ``tok``, its blocks and ``ln`` to split: a pp beyond that is refused naming the units."""
    with pytest.raises(ModelError, match=r"the built-in model over a mesh with pp=16: .*use pp <="):
        probe_meshes(None, [Mesh.parse("pp=16")])


class _Inner:
    """A strategy wrap that synchronized ``syncs`` times."""

    def __init__(self, module: nn.Module, syncs: int, notes: tuple[str, ...] = ()) -> None:
        self.module, self.syncs, self._notes, self.no_sync = module, syncs, notes, "model.no_sync()"

    def reset_syncs(self) -> None:
        self.syncs = 0

    def notes(self) -> tuple[str, ...]:
        return self._notes


def _wrapped(counts: list[int], notes: tuple[str, ...] = ()) -> pipeline.PipelineWrapped:
    model = _model()
    stages = pipeline.builtin_split(model, 2 * len(counts))[:len(counts)]
    return pipeline.PipelineWrapped(model, stages, [_Inner(m, c, notes) for m, c in zip(stages, counts, strict=True)],
                                    None)  # type: ignore[arg-type]


@pytest.mark.parametrize(("counts", "syncs"), [([1, 1], 1), ([1, 0], 0), ([0, 1], 0), ([2, 1], 2), ([1, 3], 3),
                                               ([2, 2], 2), ([0, 0], 0), ([1], 1), ([2], 2)])
def test_a_rank_of_several_stages_synchronized_once_only_when_each_stage_did(counts: list[int], syncs: int) -> None:
    """one_sync reads one count per rank: each local stage module synchronizes over dp on its own, so the window
    counts one when every one of them synchronized once, and otherwise the count farthest from one (a stage that
    never synchronized gives 0 even beside one that did: the negative control of the aggregation)."""
    wrapped = _wrapped(counts)
    assert syncs == wrapped.syncs
    wrapped.reset_syncs()
    assert 0 == wrapped.syncs


def test_several_stages_hold_their_parameters_and_share_their_notes_once() -> None:
    """The gather takes every local stage's parameters (rank 0 of pp=2 interleaved: stages 0 and 2), and a note two
    stages' wraps both give is reported once."""
    model = _model()
    stages = pipeline.builtin_split(model, 4)
    mine = [stages[i] for i in pipeline.local_stages(0, 2, 2)]
    wrapped = pipeline.PipelineWrapped(model, mine, [_Inner(m, 1, ("a note",)) for m in mine],
                                       None)  # type: ignore[arg-type]
    held = [name for (name, _), h in zip(model.named_parameters(), wrapped._held, strict=True) if h]
    assert sorted(n for m in mine for n, _ in m.named_parameters()) == sorted(held)
    assert any(n.startswith("tok.") for n in held) and any(n.startswith("ln.") for n in held)
    assert not any(n.startswith(("blocks.", "head.")) for n in held)
    assert ("a note",) == wrapped.notes()
    assert isinstance(wrapped.module, nn.ModuleList) and 2 == len(wrapped.module)


class _FakePipeline:
    """The last stage of a pp-only pipeline without ranks: ``step`` calls ``loss_fn`` once on placeholder logits
    first (as a new schedule's shape inference does), then on each microbatch of the step, and returns those losses
    (``copies``: new tensors of the same values instead, as no torch schedule does)."""

    token_group, token_group_size, is_last = None, 1, True

    def __init__(self, model: nn.Module, copies: bool = False) -> None:
        self.model, self.copies = model, copies

    def schedule(self, loss_fn: Any, n_microbatches: int, *, scale_grads: bool) -> Any:
        return loss_fn, n_microbatches

    batch = staticmethod(pipeline.Pipeline.batch)
    batches = staticmethod(pipeline.Pipeline.batches)

    def step(self, schedule: Any, inputs: torch.Tensor, labels: torch.Tensor) -> list[torch.Tensor]:
        loss_fn, n = schedule
        loss_fn(torch.zeros(1, inputs.shape[1], 32), torch.ones(1, inputs.shape[1], dtype=torch.long))
        losses = [loss_fn(self.model(x), y) for x, y in zip(inputs.chunk(n), labels.chunk(n), strict=True)]
        return [loss.detach().clone() for loss in losses] if self.copies else losses

    def from_last(self, value: float) -> float:
        return value


def _window() -> list[Microbatch]:
    return [Microbatch(torch.randint(1, 10, (2, 5), generator=G), torch.randint(1, 10, (2, 5), generator=G)),
            Microbatch(torch.randint(1, 10, (1, 8), generator=G), torch.randint(1, 10, (1, 8), generator=G))]


def test_the_window_loss_sums_the_steps_own_losses_and_not_the_shape_inferences() -> None:
    """drive() takes the losses the schedule returns, matched to loss_fn's calls by identity: the extra call on the
    placeholder output (shape inference, under every schedule) is left out, and the logged loss is the window's
    token mean."""
    from harness.recipes.pipelined import drive

    model = _model()
    window = _window()
    with torch.no_grad():
        got = drive(_FakePipeline(model), window, 2, steps=2)
        want = sum(float(loss_sum(model(mb.inputs), mb.labels)) for mb in window) / sum(mb.supervised for mb in window)
    assert want == pytest.approx(got, rel=1e-6)


def test_losses_that_are_not_loss_fns_own_are_refused() -> None:
    """Its negative control: losses the schedule did not get from loss_fn match no call, and drive() says so rather
    than logging a sum of the wrong calls."""
    from harness.recipes.pipelined import drive

    with torch.no_grad(), pytest.raises(RuntimeError, match="returned 2 losses matching 0 loss_fn calls"):
        drive(_FakePipeline(_model(), copies=True), _window(), 2)
