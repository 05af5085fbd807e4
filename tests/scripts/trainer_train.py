"""A transformers ``Trainer`` script, written as its documentation shows, for the audit to run unchanged:
``torchrun --nproc-per-node 2 trainer_train.py [--local-average]``. A Llama built from a config, rows of different
lengths padded by a collator, two microbatches of accumulation. ``--local-average`` sets
``average_tokens_across_devices=False`` (each rank's tokens averaged alone: a mean of local means);
``--max-grad-norm X`` sets the Trainer's clip (default 1.0, the Trainer's own)."""

import argparse
import tempfile

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments


def collate(rows):
    width = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        ids[i, :n] = torch.tensor(r["input_ids"])
        mask[i, :n] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--local-average", action="store_true")
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    g = torch.Generator().manual_seed(1)
    data = [{"input_ids": torch.randint(1, 32, (int(n),), generator=g).tolist()}
            for n in torch.randint(3, 40, (64,), generator=g)]
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    training = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=2,
                                 gradient_accumulation_steps=2, max_steps=args.steps, learning_rate=1e-3, use_cpu=True,
                                 report_to="none", save_strategy="no", logging_strategy="no",
                                 average_tokens_across_devices=not args.local_average,
                                 max_grad_norm=args.max_grad_norm)
    Trainer(model=model, args=training, train_dataset=data, data_collator=collate).train()


if __name__ == "__main__":
    main()
