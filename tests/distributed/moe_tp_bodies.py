"""Rank bodies for ``test_moe_tensor_parallel.py``: one microbatch through the MoE model's tensor-parallel plan under
FSDP2 over ``dp=2,tp=2``, compared with the unsharded model.

Imported by plain name: the test puts this folder on ``sys.path``, which each rank inherits from the caller.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from harness.moe_tp import moe, moe_tp_plan


def largest_error_on_two_tokens(call_every_expert: bool) -> float:
    """Each dp coordinate runs one row of two tokens, one per tp rank (each token picks 2 of the 4 experts, so a tp
    rank leaves some experts unused); the largest gap between the gathered gradient and the unsharded model's.
    ``call_every_expert=False`` puts back the layer's own dispatch, which skips an expert no token chose."""
    torch.manual_seed(0)
    ref = moe()
    torch.manual_seed(0)
    model = moe()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    moe_tp_plan(model, mesh["tp"])
    if not call_every_expert:
        for layer in model.moe_layers():
            layer.dispatch = None
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    g = torch.Generator().manual_seed(1)
    inputs = torch.randint(1, 16, (2, 1, 2), generator=g)
    labels = torch.randint(1, 16, (2, 1, 2), generator=g)
    d = mesh["dp"].get_local_rank()
    # The token mean over the 4 tokens of both dp coordinates, times dp for FSDP2's average over dp.
    loss = F.cross_entropy(model(inputs[d]).flatten(0, 1), labels[d].flatten(), reduction="sum") / 4 * 2
    loss.backward()
    got = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
    F.cross_entropy(ref(inputs.flatten(0, 1)).flatten(0, 1), labels.flatten(), reduction="sum").div(4).backward()
    worst = 0.0
    for n, p in ref.named_parameters():
        want = torch.zeros_like(p) if p.grad is None else p.grad
        worst = max(worst, float((got.get(n, torch.zeros_like(p)) - want).abs().max()))
    return worst
