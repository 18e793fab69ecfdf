"""How fast the demo model learns the verifiable tasks (data/tasks/): supervised steps on task examples only, from a
pretrained checkpoint, with exact accuracy on the held-out val problems every ``--every`` steps.

    .venv/bin/python bench/sweep_tasks.py --init checkpoints/pretrain --optimizer muon --steps 600
    .venv/bin/python bench/sweep_tasks.py --init checkpoints/pretrain --family arithmetic --only_addition
    .venv/bin/python bench/sweep_tasks.py --init checkpoints/pretrain --family arithmetic --units_first

It is the question behind the demo's recipe for the verifiable path: how many updates, with which optimizer, the
tasks need before the SFT model answers 10-60% of held-out problems (bench/README.md has the table). The examples
are the training split's, laid out by the chat template as 1-SFT.py lays them out; the data order, the warm-up +
cosine schedule and the clipping are the stages'. ``--only_addition`` keeps the sums; ``--units_first`` writes the
answers from the units digit (as Lee et al. 2023 found small transformers learn addition faster), scored by exact
string match.
"""

from __future__ import annotations

import os
import sys
import time
import types

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # the repository root

import torch

from plumbing.batching import BatchSchedule, ChatPairs, length_grouped_batches
from plumbing.checkpoint import load_checkpoint
from plumbing.cli import ArgumentParser, default_path, run
from plumbing.held_out import measure
from plumbing.optimizers import lr_at, make_optimizer, set_lr
from plumbing.records import read_tasks
from plumbing.tasks import describe_tasks, task_monitors


def parse_args(argv=None):
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--init", default=default_path("checkpoints", "pretrain"), help="the checkpoint to start from")
    p.add_argument("--steps", type=int, default=600, help="optimizer steps")
    p.add_argument("--every", type=int, default=200, help="measure every N steps")
    p.add_argument("--learning_rate", type=float, default=2e-3, help="peak rate (Muon's matrices: 10x)")
    p.add_argument("--optimizer", choices=["adamw", "muon"], default="muon")
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("--warmup_steps", type=int, default=20)
    p.add_argument("--family", choices=["arithmetic", "reverse", "both"], default="both")
    p.add_argument("--only_addition", action="store_true", help="keep the sums of the arithmetic family")
    p.add_argument("--units_first", action="store_true", help="arithmetic answers from the units digit")
    p.add_argument("--samples", type=int, default=4, help="samples per val problem for sampled pass@1")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def variant(tasks, args):
    """The tasks of the family asked for, with the arithmetic variants applied."""
    out = []
    for t in tasks:
        if args.family != "both" and t["family"] != args.family:
            continue
        if t["family"] == "arithmetic":
            if args.only_addition and "加" not in t["prompt"]:
                continue
            if args.units_first:  # scored as an exact string: a reversed number may start with 〇
                t = {"prompt": t["prompt"] + "，从个位写起", "answer": t["answer"][::-1], "family": "reverse"}
        out.append(t)
    return out


def main(argv=None):
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    model, tokenizer, _ = load_checkpoint(args.init, "gpt")
    model.train()
    train = variant(read_tasks(default_path("data", "tasks", "train.jsonl"), "train"), args)
    val = variant(read_tasks(default_path("data", "tasks", "val.jsonl"), "val"), args)
    pairs = ChatPairs([{"prompt": t["prompt"], "response": t["answer"]} for t in train], tokenizer, 64)
    batches = length_grouped_batches(pairs.lengths, args.batch_size)
    schedule = BatchSchedule(len(batches), 1, 1, 1, args.seed)
    optimizer = make_optimizer(model, args.learning_rate, 0.1, args.optimizer)
    print(f"{len(train)} training problems, {len(val)} val problems; {args.optimizer}, batch {args.batch_size}",
          flush=True)
    started = time.time()
    for step in range(args.steps):
        set_lr(optimizer, lr_at(step, args.learning_rate, args.warmup_steps, args.steps))
        batch = pairs.collate(batches[schedule.indices(step, 0, 0)[0]])
        loss = model(batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"])["loss"]
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        if (step + 1) % args.every == 0:
            model.eval()
            rows = measure(model, model, val, args.samples, tokenizer,
                           types.SimpleNamespace(max_new_tokens=8, seed=1), model.cfg.context_length, "cpu",
                           verifier="exact")
            monitors = task_monitors(rows, val, args.samples)
            model.train()
            print(f"step {step + 1}: train loss {loss.item():.3f}, {time.time() - started:.0f} s; "
                  f"{describe_tasks(monitors)}", flush=True)
    return 0


if __name__ == "__main__":
    run(main)
