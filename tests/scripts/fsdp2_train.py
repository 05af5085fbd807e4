"""A plain PyTorch FSDP2 training script, written as a user writes one, for the audit to run unchanged:
``torchrun --nproc-per-node 2 fsdp2_train.py [--wrong local_count|always_sync] [--hsdp]``.

A small causal LM of two residual blocks called the Hugging Face way, each block and then the root sharded with
``fully_shard``, a DistributedSampler over rows of different lengths, a padding collator, and two microbatches per
step with gradient sync off for the first (``set_requires_gradient_sync(False)``) and on for the last. Right: each
microbatch's loss sum divided by the step's token count all-reduced over the ranks, times the world size (FSDP2
averages over the ranks). ``--wrong local_count``: divided by the rank's own count instead (a mean of local means);
``always_sync``: gradient sync left on for both microbatches (the gradient is right, the reduce-scatters doubled).
``--hsdp``: sharded over a 2-D device mesh (dp_replicate=1 x dp_shard=W)."""

import argparse
import gc
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, DistributedSampler


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, h):
        return h + self.down(F.gelu(self.up(self.norm(h))))


class TinyBlocksLM(nn.Module):
    def __init__(self, vocab=32, dim=16, n_blocks=2):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(n_blocks))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, input_ids, attention_mask=None, labels=None):
        positions = torch.arange(1, input_ids.size(1) + 1, device=input_ids.device).view(1, -1, 1)
        h = torch.cumsum(self.emb(input_ids), dim=1) / positions  # causal mean: position t sees tokens up to t
        for block in self.blocks:
            h = block(h)
        logits = self.head(self.norm(h))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
        return SimpleNamespace(logits=logits, loss=loss)


def collate(rows):
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = r
        mask[i, : len(r)] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--wrong", choices=["local_count", "always_sync"], default=None)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--hsdp", action="store_true")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(1, 32, (int(n),), generator=g) for n in torch.randint(3, 40, (64,), generator=g)]
    loader = DataLoader(data, batch_size=2, sampler=DistributedSampler(data, shuffle=True, seed=0), collate_fn=collate)
    model = TinyBlocksLM()
    mesh = None
    if args.hsdp:
        mesh = init_device_mesh("cpu", (1, dist.get_world_size()), mesh_dim_names=("dp_replicate", "dp_shard"))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = iter(loader)
    for _ in range(args.steps):
        mbs = [next(batches), next(batches)]
        counts = [int((b["labels"][:, 1:] != -100).sum()) for b in mbs]
        total = torch.tensor(sum(counts))
        if args.wrong != "local_count":
            dist.all_reduce(total)
        for i, (b, n) in enumerate(zip(mbs, counts)):
            model.set_requires_gradient_sync(i == len(mbs) - 1 or args.wrong == "always_sync")
            out = model(**b)
            loss = out.loss * n / total * dist.get_world_size()
            if args.wrong == "local_count":
                loss = out.loss * n / total
            loss.backward()
        opt.step()
        opt.zero_grad()
    del model, opt, batches, loader
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
