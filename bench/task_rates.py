"""Per-problem pass rates of a checkpoint on verifiable problems: what GRPO will have to learn from.

    .venv/bin/python bench/task_rates.py --policy checkpoints/sft --tasks data/tasks/val.jsonl --samples 16

For each family (and each kind of instruction), samples ``--samples`` answers per problem at temperature 1 and one
greedy answer, scores them with the strict checker (``verifiers.check``, ended with ``[SEP]``), and prints greedy
accuracy, sampled pass@1 with its standard error over problems, and how the per-problem rates spread: the share of
problems whose samples were all right or all wrong (a GRPO group of that problem would teach nothing: every
advantage zero) and a histogram of the rates. GRPO needs problems the model solves sometimes, not always or never.
For the instructions it also counts the sampled answers that copy their prompt (``verifiers.echoes``) and the
pass@1 the checker would give without that guard (the prompt left out): what the echo rule takes away.
"""

from __future__ import annotations

import os
import sys
import time
from collections import defaultdict

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # the repository root

import torch

from chinese_tokenizer import EOS_ID, chat_prompt_ids, load_tokenizer
from gpt_fast import generate, speed_up
from plumbing.batching import pad_left
from plumbing.checkpoint import load_checkpoint
from plumbing.cli import ArgumentParser, default_path, positive_int, run
from plumbing.judge import mean_and_se
from plumbing.records import read_tasks
from plumbing.tasks import generated_answers, solved
from plumbing.verifiers import FAMILIES, check, echoes


def parse_args(argv=None):
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--policy", default=default_path("checkpoints", "sft"), help="the checkpoint to measure")
    p.add_argument("--tasks", nargs="+", default=[default_path("data", "tasks", "val.jsonl")], help="problem files")
    p.add_argument("--family", choices=FAMILIES, default=None, help="only this family")
    p.add_argument("--samples", type=positive_int, default=16, help="answers per problem at temperature 1")
    p.add_argument("--max_new_tokens", type=positive_int, default=100,
                   help="the longest answer in tokens (an instruction's review needs about 100; a sum 8)")
    p.add_argument("--batch", type=positive_int, default=32, help="problems per generate call")
    p.add_argument("--limit", type=int, default=0, help="measure at most this many problems per family (0: all)")
    p.add_argument("--seed", type=int, default=0, help="torch's seed for the samples")
    p.add_argument("--show", type=int, default=0, help="print this many sampled answers per scope")
    return p.parse_args(argv)


def scope_of(task: dict) -> str:
    """The family, and for an instruction its kind: ``instruction/max_chars``."""
    return task["family"] + ("/" + task["answer"].split(":")[0] if task["family"] == "instruction" else "")


@torch.no_grad()
def main(argv=None):
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    tokenizer = load_tokenizer(default_path("data", "tokenizer"))
    model = speed_up(load_checkpoint(args.policy, "gpt", flag="--policy")[0].eval())
    tasks = [t for t in read_tasks(args.tasks, "--tasks") if args.family in (None, t["family"])]
    if args.limit:
        kept, count = [], defaultdict(int)
        for t in tasks:
            count[scope_of(t)] += 1
            if count[scope_of(t)] <= args.limit:
                kept.append(t)
        tasks = kept
    ctx = model.cfg.context_length
    start = time.time()
    greedy, rates, shown = defaultdict(list), defaultdict(list), defaultdict(list)
    echoed, unguarded = defaultdict(list), defaultdict(list)  # per sampled answer: copies its prompt; right without
    for i in range(0, len(tasks), args.batch):
        batch = tasks[i:i + args.batch]
        prompt = pad_left([chat_prompt_ids(t["prompt"], tokenizer, ctx - args.max_new_tokens) for t in batch])
        ids, mask = prompt["input_ids"], prompt["attention_mask"]
        out = generate(model, ids, args.max_new_tokens, ctx, eos_id=EOS_ID, attention_mask=mask)
        texts, ended, _ = generated_answers(out, ids.shape[1], tokenizer)
        for t, x, e in zip(batch, texts, ended):
            greedy[scope_of(t)].append(float(solved(t, x, e)))
        out = generate(model, ids, args.max_new_tokens, ctx, temperature=1.0, eos_id=EOS_ID, attention_mask=mask,
                       num_samples=args.samples)
        texts, ended, _ = generated_answers(out, ids.shape[1], tokenizer)
        for j, t in enumerate(batch):
            rows = range(j * args.samples, (j + 1) * args.samples)
            right = [solved(t, texts[r], ended[r]) for r in rows]
            rates[scope_of(t)].append(sum(right) / args.samples)
            if t["family"] == "instruction":
                echoed[scope_of(t)] += [texts[r] is not None and echoes(texts[r], t["prompt"]) for r in rows]
                unguarded[scope_of(t)] += [bool(ended[r]) and texts[r] is not None
                                           and check(t["family"], texts[r], t["answer"]) for r in rows]
            if len(shown[scope_of(t)]) < args.show:
                shown[scope_of(t)].append((t["prompt"], texts[rows[0]], right[0]))
    print(f"{args.policy}: {len(tasks)} problems x {args.samples} samples, {time.time() - start:.0f} s")
    print("| scope | problems | greedy | sampled pass@1 | all right | all wrong | rates 0 / (0,.25] / (.25,.5] / "
          "(.5,.75] / (.75,1) / 1 |")
    print("|---|---|---|---|---|---|---|")
    for scope in sorted(rates):
        r = rates[scope]
        mean, se = mean_and_se(r)
        bins = [sum(x == 0 for x in r), sum(0 < x <= .25 for x in r), sum(.25 < x <= .5 for x in r),
                sum(.5 < x <= .75 for x in r), sum(.75 < x < 1 for x in r), sum(x == 1 for x in r)]
        print(f"| {scope} | {len(r)} | {sum(greedy[scope]) / len(r):.1%} | {mean:.1%} ± {se:.1%} | "
              f"{bins[-1] / len(r):.0%} | {bins[0] / len(r):.0%} | {' / '.join(map(str, bins))} |")
    for scope in sorted(echoed):
        print(f"{scope}: {sum(echoed[scope])} of {len(echoed[scope])} sampled answers copy their prompt; pass@1 "
              f"without the echo guard {sum(unguarded[scope]) / len(unguarded[scope]):.1%}")
    for scope, rows in shown.items():
        for prompt, text, ok in rows:
            print(f"  [{scope}] {prompt} -> {text} ({'right' if ok else 'wrong'})")


if __name__ == "__main__":
    run(main)
