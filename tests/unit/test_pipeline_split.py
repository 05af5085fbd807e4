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
from harness.battery.facts import probe_meshes
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
    assert [["tok"], ["blocks.0", "ln"]] == pipeline.cut(pipeline.builtin_units(model), 2, ["blocks.0"])
    assert [["tok", "blocks.0"], ["ln"]] == pipeline.cut(pipeline.builtin_units(model), 2)
    with pytest.raises(ValueError, match=re.escape("must name 1 of the units tok, blocks.0, ln")):
        pipeline.cut(pipeline.builtin_units(model), 2, ["blocks.7"])
    with pytest.raises(ValueError, match="4 pipeline stages but the model has 3 units"):
        pipeline.cut(pipeline.builtin_units(model), 4)


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
    """:func:`harness.battery.facts.probe_meshes` (what the pytest plugin and the command line call before the first
    case) refuses a split that loses part of the forward as a usage error naming the model and the pp size; the same
    model without the function between its children passes, and a mesh without pp asks nothing of the split."""
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
