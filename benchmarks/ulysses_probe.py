"""Whether a recipe can tell Ulysses sequence parallelism from cp's gathered attention (docs/layout.md).

Four gloo ranks on a ``dp=2,cp=2`` mesh, float64: each builds ``harness.ulysses:ulysses`` and
``harness.model:sequence_sharded`` from one seed, takes its data coordinate's microbatch (random ids, a prompt and
right padding unsupervised), keeps its cp chunk (:func:`harness.data.context_parallel.shard_chunk`), and backpropagates
its chunk's loss sum with no synchronization. It prints, over the ranks and both chunkings, the largest difference
between the two models' per-rank gradients (what a recipe scales before the ranks' average) and between the sum of
each data coordinate's cp ranks' gradients and the whole-sequence gradient on one device.

    python benchmarks/ulysses_probe.py
"""

from __future__ import annotations

import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from harness.core.compare import flat_grad
from harness.core.loss import loss_sum
from harness.core.microbatch import IGNORE_INDEX, Microbatch
from harness.data.config import Config
from harness.data.context_parallel import shard_chunk


def _batch(data_rank: int) -> Microbatch:
    g = torch.Generator().manual_seed(100 + data_rank)
    b, t = 3, 23 + 2 * data_rank  # odd lengths: the chunks differ by a column
    inputs = torch.randint(1, Config().vocab_size, (b, t), generator=g)
    labels = torch.randint(1, Config().vocab_size, (b, t), generator=g)
    labels[:, :3] = IGNORE_INDEX  # a prompt
    inputs[0, -4:], labels[0, -4:] = 0, IGNORE_INDEX  # right padding
    return Microbatch(inputs, labels)


def _grad(factory_path: str, mb: Microbatch, mesh: object | None) -> torch.Tensor:
    from harness.distributed.sequence_sharding import plan_of
    from harness.model import load_model_factory

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        model = load_model_factory(factory_path)().double()
    if mesh is not None:
        plan = plan_of(factory_path)
        assert plan is not None
        plan(model, mesh)
    out = model(mb.inputs) if mb.positions is None else model(mb.inputs, position_ids=mb.positions)
    loss_sum(out, mb.labels).backward()
    return flat_grad(model)


def _body(rank: int, world: int, path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    dp, cp = mesh.get_coordinate()  # type: ignore[misc]
    worst_apart, worst_sum = 0.0, 0.0
    for chunking in ("contiguous", "load_balanced"):
        mb = _batch(dp)
        chunk = shard_chunk(mb, cp, 2, chunking)
        ulysses = _grad("harness.ulysses:ulysses", chunk, mesh["cp"])
        gathered = _grad("harness.model:sequence_sharded", chunk, mesh["cp"])
        worst_apart = max(worst_apart, float((ulysses - gathered).abs().max()))
        total = ulysses.clone()
        dist.all_reduce(total, group=mesh["cp"].get_group())
        whole = _grad("harness.model:sequence_sharded", mb, None)
        worst_sum = max(worst_sum, float((total - whole).abs().max()))
    found = torch.tensor([worst_apart, worst_sum], dtype=torch.float64)
    dist.all_reduce(found, op=dist.ReduceOp.MAX)
    if rank == 0:
        print(f"largest |ulysses - gathered| per-rank gradient difference: {float(found[0]):.1e}")
        print(f"largest |sum over cp of ulysses - whole sequence| gradient difference: {float(found[1]):.1e}")
    dist.destroy_process_group()


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_body, args=(4, f"{d}/store"), nprocs=4)
