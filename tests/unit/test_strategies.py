"""The strategy seam (:mod:`harness.distributed.strategies`): one module per strategy, each registered by itself, and
nothing above the seam building a DDP of its own."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from torch import nn

from harness.distributed import strategies
from harness.distributed.strategies import fsdp2

HARNESS = Path(__file__).parents[2] / "harness"
SEAM = HARNESS / "distributed" / "strategies"


def test_every_strategy_module_registers_its_strategy_under_its_module_name() -> None:
    """A module under strategies/ (but the protocol's) is one strategy, registered under the module's name."""
    modules = {p.stem for p in SEAM.glob("*.py")} - {"__init__", "base"}
    assert modules == set(strategies.STRATEGIES)


def test_an_unknown_strategy_is_refused_naming_the_known_ones() -> None:
    """get() says which names exist."""
    with pytest.raises(ValueError, match="strategy='fsdp9' must be one of ddp"):
        strategies.get("fsdp9")


def test_a_strategy_is_registered_once() -> None:
    """A second strategy under a taken name is an error, not a silent replacement."""
    with pytest.raises(ValueError, match="registered twice"):
        strategies.register(strategies.get("ddp"))


def _builds_ddp(source: str) -> bool:
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            if name in ("DDP", "DistributedDataParallel"):
                return True
    return False


def test_ddp_is_built_in_exactly_one_place_of_the_product() -> None:
    """Only strategies/ddp.py constructs a DistributedDataParallel inside the package (the one-layer DDPs of the
    symmetry bodies and the DDP probe are test code, in tests/support/; the resume examples are a user's own
    training loop, written without the harness, so they build their own)."""
    examples = HARNESS / "resume" / "examples"
    builders = sorted(str(p.relative_to(HARNESS)) for p in HARNESS.rglob("*.py")
                      if examples not in p.parents and _builds_ddp(p.read_text()))
    assert ["distributed/strategies/ddp.py"] == builders


def test_the_ddp_check_sees_a_construction() -> None:
    """Its negative control: a module that calls DDP(...) is found."""
    assert _builds_ddp("from torch.nn.parallel import DistributedDataParallel as DDP\nm = DDP(model)\n")
    assert not _builds_ddp("from torch.nn.parallel import DistributedDataParallel as DDP\n")


class _Blocks(nn.Module):
    """A transformer's shape: an embedding, blocks in a ModuleList, a norm, a head; ``tie`` shares the head's weight
    with the embedding."""

    def __init__(self, tie: bool = False) -> None:
        super().__init__()
        with torch.random.fork_rng():  # the suite's leak check holds the global generator to its state
            self._build(tie)

    def _build(self, tie: bool) -> None:
        self.emb = nn.Embedding(8, 4)
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
        self.norm = nn.LayerNorm(4)
        self.act = nn.ReLU()
        self.head = nn.Linear(4, 8, bias=False)
        if tie:
            self.head.weight = self.emb.weight


def test_fsdp2_shards_every_block_and_child_that_owns_parameters_then_the_root() -> None:
    """Blocks of a ModuleList first (innermost), then the children with parameters, the root last; a child without
    parameters (an activation) is no group."""
    model = _Blocks()
    got = fsdp2.groups(model)
    assert [model.layers[0], model.layers[1], model.emb, model.norm, model.head, model] == got


def test_fsdp2_shards_the_root_alone_when_weights_are_tied() -> None:
    """A parameter cannot live in two groups: a tied head and embedding leave one group, the root."""
    model = _Blocks(tie=True)
    assert [model] == fsdp2.groups(model)


def test_the_step_moves_every_weight_with_a_gradient_by_minus_lr_times_it() -> None:
    """``sgd_step`` on plain tensors (held whole) is ``p.add_(p.grad, alpha=-lr)``; a weight without a gradient stays
    as it was."""
    model = _Blocks()
    before = [p.detach().clone() for p in model.parameters()]
    generator = torch.Generator().manual_seed(0)
    for p in list(model.parameters())[1:]:
        p.grad = torch.randn(p.shape, generator=generator)
    fsdp2.sgd_step(model, 0.1)
    for (i, p), b in zip(enumerate(model.parameters()), before, strict=True):
        expected = b if p.grad is None else b.add(p.grad, alpha=-0.1)
        assert torch.equal(p.detach(), expected), i
    assert not torch.equal(list(model.parameters())[1].detach(), before[1])


def test_a_recipe_declares_the_reduction_it_is_written_for() -> None:
    """``reduction = "sum"`` is read from the recipe; no declaration is the average; anything else is refused
    naming the fix."""
    from harness.battery.rank.rank_program import declared_reduction
    from harness.recipes import global_token_mean, summed_global_token_mean

    assert "sum" == declared_reduction(summed_global_token_mean)
    assert "mean" == declared_reduction(global_token_mean)

    class Bad:
        reduction = "avg"

    with pytest.raises(ValueError, match=r"Bad.reduction='avg' must be 'mean' .* or 'sum'"):
        declared_reduction(Bad())


def test_one_strategy_s_way_to_skip_a_sync_under_the_other_is_named() -> None:
    """The AttributeError of ``no_sync`` on an FSDP2 model (and of ``set_requires_gradient_sync`` on a DDP) becomes
    a usage error saying what to call instead; any other AttributeError is left alone."""
    from harness.battery.rank.rank_program import strategy_mismatch

    said = strategy_mismatch("'FSDPTinyCausalLM' object has no attribute 'no_sync'", "fsdp2")
    assert said is not None and "model.set_requires_gradient_sync(False)" in said and "sync_context" in said
    said = strategy_mismatch("'DistributedDataParallel' object has no attribute 'set_requires_gradient_sync'", "ddp")
    assert said is not None and "under ddp use model.no_sync()" in said
    assert strategy_mismatch("'Linear' object has no attribute 'no_sync'", "ddp") is None
    assert strategy_mismatch("'Tensor' object has no attribute 'foo'", "fsdp2") is None
