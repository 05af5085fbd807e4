"""A nanoGPT-style training script, written as karpathy/nanoGPT's train.py writes one, for the audit to run unchanged:
``torchrun --nproc-per-node 2 nanogpt_train.py [--wrong accumulation_mean|local_count] [--grad-clip 0]``. A tiny GPT
returning ``(logits, loss)``, rows from a random token stream with a drawn suffix of each target row ignored (-1), two
micro-steps per step under DDP with ``require_backward_grad_sync`` set on the last, clipping, AdamW. Right: each
micro-step's mean loss times its token count, over the step's count all-reduced over the ranks, times the world size.
``--wrong accumulation_mean``: nanoGPT's ``loss / gradient_accumulation_steps``; ``local_count``: its own count.
``--device cuda --backend nccl``: each rank on its local rank's GPU, the forward under bf16 autocast (nanoGPT's
``ctx``)."""

import argparse
import gc
import os
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


@dataclass
class GPTConfig:
    block_size: int = 32
    vocab_size: int = 32
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 32
    dropout: float = 0.0


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_attn, self.c_proj = nn.Linear(config.n_embd, 3 * config.n_embd), nn.Linear(config.n_embd, config.n_embd)
        self.n_head, self.dropout = config.n_head, config.dropout

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in self.c_attn(x).split(C, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        C = config.n_embd
        self.ln_1, self.attn, self.ln_2 = nn.LayerNorm(C), CausalSelfAttention(config), nn.LayerNorm(C)
        self.mlp = nn.Sequential(nn.Linear(C, 4 * C), nn.GELU(), nn.Linear(4 * C, C), nn.Dropout(config.dropout))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        C = config.n_embd
        self.wte, self.wpe = nn.Embedding(config.vocab_size, C), nn.Embedding(config.block_size, C)
        self.h = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f, self.lm_head = nn.LayerNorm(C), nn.Linear(C, config.vocab_size, bias=False)

    def forward(self, idx, targets=None):
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device))
        for block in self.h:
            x = block(x)
        x = self.ln_f(x)
        if targets is None:
            return self.lm_head(x[:, [-1], :]), None
        logits = self.lm_head(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--wrong", choices=["accumulation_mean", "local_count"], default=None)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--grad-clip", type=float, default=1.0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--backend", default="gloo")
    args = parser.parse_args()
    dist.init_process_group(args.backend)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = args.device
    if device == "cuda":
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0')) % torch.cuda.device_count()}"
        torch.cuda.set_device(device)
    device_type = "cuda" if "cuda" in device else "cpu"
    ctx = nullcontext() if device_type == "cpu" else torch.amp.autocast(device_type=device_type, dtype=torch.bfloat16)
    gradient_accumulation_steps, batch_size, grad_clip = 2, 4, args.grad_clip
    config, T = GPTConfig(), GPTConfig.block_size
    g = torch.Generator().manual_seed(1000 + rank)
    data = torch.randint(0, config.vocab_size, (4096,), generator=g)

    def get_batch():
        ix = torch.randint(len(data) - T - 1, (batch_size,), generator=g)
        x, y = (torch.stack([data[i + o : i + o + T] for i in ix]) for o in (0, 1))
        keep = torch.randint(4, T + 1, (batch_size, 1), generator=g)
        return x.to(device), y.masked_fill(torch.arange(T) >= keep, -1).to(device)

    torch.manual_seed(0)
    model = DDP(GPT(config).to(device))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(args.steps):
        batches = [get_batch() for _ in range(gradient_accumulation_steps)]
        counts = [int((Y != -1).sum()) for _, Y in batches]
        total = torch.tensor(sum(counts), device=device)
        if args.wrong is None:
            dist.all_reduce(total)
        for micro_step, ((X, Y), n_mb) in enumerate(zip(batches, counts)):
            model.require_backward_grad_sync = micro_step == gradient_accumulation_steps - 1
            with ctx:
                logits, loss = model(X, Y)  # noqa: RUF059
            if args.wrong == "accumulation_mean":
                loss = loss / gradient_accumulation_steps
            elif args.wrong == "local_count":
                loss = loss * n_mb / total
            else:
                loss = loss * n_mb / total * world_size
            loss.backward()
        if grad_clip != 0.0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    del model, optimizer
    gc.collect()  # DDP's reducer gone before its process group: without it 1 run in 6 aborted at exit here
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
