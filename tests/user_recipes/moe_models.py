"""A mixture-of-experts LM written as a user writes one: its own gate and ModuleList of experts, a LayerNorm, an
unused value head, and its own expert-parallel plan (an all-gather dispatch with a hand-written backward, and an
all-reduce combine), declared beside the factory with ``moe_plan`` and ``ep_plan``: the harness knows only those."""
import torch
import torch.distributed as dist
from torch import nn

from harness.moe import MoePlan


class Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        dist.all_reduce(g, group=ctx.group)
        n = g.shape[0] // dist.get_world_size(ctx.group)
        r = dist.get_rank(ctx.group)
        return g[r * n:(r + 1) * n], None


class SumAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


class Expert(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class SparseMoE(nn.Module):
    def __init__(self, d, n_experts=4, k=2):
        super().__init__()
        self.gate = nn.Linear(d, n_experts, bias=False)
        self.experts = nn.ModuleList(Expert(d) for _ in range(n_experts))
        self.k = k
        self.group = None
        self.mine = list(range(n_experts))

    def _local(self, x, w, idx, experts):
        out = torch.zeros_like(x)
        for e in experts:
            t, s = (idx == e).nonzero(as_tuple=True)
            out = out.index_add(0, t, self.experts[e](x[t]) * w[t, s, None])
        return out

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        w, idx = self.gate(x).softmax(-1).topk(self.k, dim=-1)
        w = w / w.sum(-1, keepdim=True)
        if self.group is None:
            return self._local(x, w, idx, self.mine).view(shape)
        # every ep rank gets every rank's tokens (padded to the longest), computes its experts, sums back
        n = torch.tensor([x.shape[0]])
        sizes = [torch.zeros(1, dtype=torch.long) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(sizes, n, group=self.group)
        most = int(max(sizes))
        pad = most - x.shape[0]
        packed = torch.cat([x, w, idx.to(x.dtype)], 1)
        packed = torch.cat([packed, packed.new_zeros(pad, packed.shape[1])])
        every = Gather.apply(packed, self.group)
        d = shape[-1]
        out = self._local(every[:, :d], every[:, d:d + self.k], every[:, d + self.k:].round().long(), self.mine)
        total = SumAll.apply(out, self.group)
        me = dist.get_rank(self.group)
        return total[me * most: me * most + x.shape[0]].view(shape)


class MyMoELM(nn.Module):
    def __init__(self, vocab=32, d=32):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.norm = nn.LayerNorm(d)
        self.moe = SparseMoE(d)
        self.head = nn.Linear(d, vocab)
        self.value_head = nn.Linear(d, 1)  # unused by the LM loss: DDP needs find_unused_parameters

    def forward(self, inputs, **kw):
        h = self.emb(inputs)
        h = h + self.moe(self.norm(h))
        return self.head(h)


def my_moe():
    return MyMoELM()


def ep_plan(model, ep_mesh):
    size, me = ep_mesh.size(), ep_mesh.get_local_rank()
    layer = model.moe
    per = len(layer.experts) // size
    layer.mine = list(range(me * per, (me + 1) * per))
    layer.group = ep_mesh.get_group()
    return [f"moe.experts.{e}.{n}" for e in layer.mine for n, _ in layer.experts[e].named_parameters()]


my_moe.moe_plan = MoePlan(experts=("moe.experts",), router=("moe.gate",))
my_moe.ep_plan = ep_plan


class EvalBetweenForwardAndBackward:
    """A correct token-mean loop that runs a no-grad forward (a logged evaluation) between each microbatch's forward
    and its backward: the expert reduction must follow the forward that prepared the backward, as DDP's does."""

    name = "eval_between_forward_and_backward"

    def backward_window(self, model, window, mesh=None):
        import torch.nn.functional as F

        from harness.recipes import global_count, require_tokens, sync_context, token_group, token_group_size

        group, size = token_group(mesh), token_group_size(mesh)
        total = require_tokens(global_count(sum(int((mb.labels != -100).sum()) for mb in window), group=group))
        for i, mb in enumerate(window):
            with sync_context(model, i, len(window)):
                logits = model(mb.inputs)
                loss = F.cross_entropy(logits.flatten(0, 1), mb.labels.flatten(), ignore_index=-100, reduction="sum")
                with torch.no_grad():
                    model(mb.inputs)
                (loss * size / total).backward()
