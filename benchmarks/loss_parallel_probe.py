"""What ``loss_parallel`` in torch 2.13 does to per-token losses on vocab-sharded DTensor logits (docs/objectives.md).

Two gloo ranks shard float64 logits ``[2, 3, 8]`` on the vocabulary (``Shard(2)`` over tp=2); each way of computing
a per-token quantity is backpropagated inside ``loss_parallel()`` and its gradient compared with the same code on the
unsharded logits, and, for the ``log_softmax`` ones, with a model whose ``log_softmax`` backward is the identity.

    python benchmarks/loss_parallel_probe.py
"""

from __future__ import annotations

import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F


def _body(rank: int, world: int, path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import loss_parallel

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    g = torch.Generator().manual_seed(0)
    b, t, v = 2, 3, 8
    z0 = torch.randn(b, t, v, generator=g, dtype=torch.float64)
    y = torch.randint(0, v, (b, t), generator=g)
    y[0, 0] = -100
    adv = torch.randn(b, t, generator=g, dtype=torch.float64)
    mask = y != -100
    safe = torch.where(mask, y, 0).unsqueeze(-1)

    def rep(x: torch.Tensor, sharded: bool) -> torch.Tensor:
        return DTensor.from_local(x, mesh, [Replicate()]) if sharded else x

    def plain(x: torch.Tensor) -> torch.Tensor:
        return x.full_tensor() if isinstance(x, DTensor) else x

    def ls(z: torch.Tensor, identity: bool) -> torch.Tensor:
        return z - torch.logsumexp(z, -1, keepdim=True).detach() if identity else F.log_softmax(z, -1)

    cases = {
        "-cross_entropy(reduction='none') as log p(y)": lambda z, s, i: -plain(F.cross_entropy(
            z.flatten(0, 1), y.flatten(), reduction="none")).view(b, t) * adv,
        "log_softmax(z).gather(-1, y), full_tensor() before squeeze": lambda z, s, i: plain(
            ls(z, i).gather(-1, rep(safe, s))).squeeze(-1) * adv,
        "entropy -(exp(log_softmax) * log_softmax).sum(-1)": lambda z, s, i: plain(
            -(ls(z, i).exp() * ls(z, i)).sum(-1)),
        "smoothing -log_softmax(z).mean(-1)": lambda z, s, i: plain(-ls(z, i).mean(-1)),
        "smoothing logsumexp(z) - z.mean(-1)": lambda z, s, i: plain(torch.logsumexp(z, -1) - z.mean(-1)),
        "entropy logsumexp(z) - (softmax(z) * z).sum(-1)": lambda z, s, i: plain(
            torch.logsumexp(z, -1) - (torch.softmax(z, -1) * z).sum(-1)),
        "cross_entropy(..., label_smoothing=0.1)": lambda z, s, i: plain(F.cross_entropy(
            z.flatten(0, 1), y.flatten(), reduction="none", label_smoothing=0.1)).view(b, t),
    }

    def grad(fn: object, sharded: bool, identity: bool = False) -> torch.Tensor:
        z = (distribute_tensor(z0.clone(), mesh, [Shard(2)]) if sharded else z0.clone()).requires_grad_(True)
        ctx = loss_parallel() if sharded else torch.enable_grad()
        with ctx:
            (fn(z, sharded, identity) * mask).sum().backward()  # type: ignore[operator]
        return plain(z.grad)  # type: ignore[arg-type]

    for name, fn in cases.items():
        try:
            right, got = grad(fn, False), grad(fn, True)
            line = f"{name}: max |sharded - unsharded| gradient {float((got - right).abs().max()):.3e}"
            if "log_softmax" in name:
                model = grad(fn, False, identity=True)
                line += f"; vs log_softmax with an identity backward {float((got - model).abs().max()):.3e}"
        except Exception as e:  # what raises is the finding
            line = f"{name}: raises {type(e).__name__}: {str(e).splitlines()[0][:120]}"
        if rank == 0:
            print(line, flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_body, args=(2, f"{d}/store"), nprocs=2)
