"""A plain PyTorch DDP training script, written as a user writes one, for the audit to run unchanged:
``torchrun --nproc-per-node 2 ddp_train.py [--wrong local_count]``. A causal LM called the Hugging Face way, a
DistributedSampler over rows of different lengths, a padding collator, and two microbatches per step with the first
under ``no_sync()``. Right: each microbatch's loss sum divided by the step's token count all-reduced over the ranks,
times the world size. ``--wrong local_count``: divided by the rank's own count instead (a mean of local means);
``accumulation_mean``: each microbatch's mean loss divided by the accumulation steps; ``never_no_sync``: both
microbatches synchronize (the gradient is right, the traffic doubled). ``--balanced``: every row 16 tokens long,
every token supervised (packed data: every rank and microbatch holds the same count). ``--device cuda --backend
nccl``: each rank on its local rank's GPU (modulo the GPUs there are: two ranks may share one over gloo)."""

import argparse
import gc
import os
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler


class TinyLM(nn.Module):
    def __init__(self, vocab=32, dim=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, input_ids, attention_mask=None, labels=None):
        h = torch.cumsum(self.emb(input_ids), dim=1)  # causal: position t sees tokens up to t
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
    parser.add_argument("--wrong", choices=["local_count", "accumulation_mean", "never_no_sync"], default=None)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--balanced", action="store_true")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--backend", default="gloo")
    args = parser.parse_args()
    dist.init_process_group(args.backend)
    device = args.device
    if device == "cuda":
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0')) % torch.cuda.device_count()}"
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    lengths = torch.full((64,), 16) if args.balanced else torch.randint(3, 40, (64,), generator=g)
    data = [torch.randint(1, 32, (int(n),), generator=g) for n in lengths]
    loader = DataLoader(data, batch_size=2, sampler=DistributedSampler(data, shuffle=True, seed=0), collate_fn=collate)
    model = DDP(TinyLM().to(device))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = iter(loader)
    for _ in range(args.steps):
        mbs = [{k: v.to(device) for k, v in next(batches).items()} for _ in range(2)]
        counts = [int((b["labels"][:, 1:] != -100).sum()) for b in mbs]
        total = torch.tensor(sum(counts), device=device)
        if args.wrong != "local_count":
            dist.all_reduce(total)
        for i, (b, n) in enumerate(zip(mbs, counts)):
            sync = i == len(mbs) - 1 or args.wrong == "never_no_sync"
            with (model.no_sync() if not sync else torch.enable_grad()):
                out = model(**b)
                loss = out.loss * n / total * dist.get_world_size()
                if args.wrong == "local_count":
                    loss = out.loss * n / total
                if args.wrong == "accumulation_mean":
                    loss = out.loss / len(mbs)
                loss.backward()
        opt.step()
        opt.zero_grad()
    if dist.get_rank() == 0:
        print(f"trained {args.steps} steps", flush=True)
    del model, opt, batches, loader
    gc.collect()  # DDP's reducer gone before its process group: without it 1 run in 10 aborted at exit here
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
