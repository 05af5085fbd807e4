"""An accelerate ``accumulate`` script, written as accelerate's documentation writes one, for the audit to run
unchanged: ``torchrun --nproc-per-node 2 accelerate_train.py [--as-documented]``. A Llama from a config, rows of
different lengths padded by a collator, ``gradient_accumulation_steps=2``. ``--as-documented``: ``backward(out.loss)``
as the guide shows, which accelerate divides by the accumulation steps: each microbatch's mean, a mean per
microbatch. Without it: each microbatch's loss sum over the step's token count gathered from every rank, times the
ranks and the steps that ``backward`` divides by."""

import argparse

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader
from transformers import LlamaConfig, LlamaForCausalLM


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
    parser.add_argument("--as-documented", action="store_true")
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    accum = 2
    accelerator = Accelerator(gradient_accumulation_steps=accum, cpu=True)
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(1, 32, (int(n),), generator=g) for n in torch.randint(3, 40, (64,), generator=g)]
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = DataLoader(data, batch_size=2, shuffle=True, collate_fn=collate)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    batches = iter(loader)
    for _ in range(args.steps):
        window = [next(batches) for _ in range(accum)]
        counts = [(b["labels"][:, 1:] != -100).sum() for b in window]
        total = accelerator.reduce(torch.stack(counts).sum(), reduction="sum")
        for b, n in zip(window, counts):
            with accelerator.accumulate(model):
                out = model(**b)
                loss = out.loss if args.as_documented else out.loss * n / total * accelerator.num_processes * accum
                accelerator.backward(loss)
                opt.step()
                opt.zero_grad()


if __name__ == "__main__":
    main()
