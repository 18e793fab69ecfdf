"""Reward models (and the report card's naive Bayes) on the RM's test and val splits: the pair accuracy the report
card shows, and the all-pairs AUC, a steadier yardstick for comparing RM recipes (bench/README.md, "Seeds, and a
steadier yardstick").

The pair accuracy counts the fixed (chosen, rejected) pairs of a split that a model ranks right; with 555 test pairs
its standard error is about 1.3 points. The all-pairs AUC ranks every chosen review of the split against every
rejected one (555 × 555 combinations; a tie counts half), so it moves much less from one run to the next.

    .venv/bin/python bench/rm_auc.py checkpoints/rm            # one or more reward-model checkpoints
    .venv/bin/python bench/rm_auc.py --no-naive-bayes other/rm
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from plumbing.baselines import NaiveBayes
from plumbing.checkpoint import load_checkpoint
from plumbing.devices import native_bf16
from plumbing.records import read_preference_pairs
from plumbing.reward import score_texts

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "rm")


def all_pairs_auc(chosen, rejected) -> float:
    """P(score of a random chosen text > score of a random rejected text), a tie counting half. (N,), (M,) -> float."""
    c, r = torch.as_tensor(chosen, dtype=torch.float64)[:, None], torch.as_tensor(rejected, dtype=torch.float64)[None]
    return ((c > r).double().mean() + 0.5 * (c == r).double().mean()).item()


def pair_accuracy(chosen, rejected) -> float:
    """The report card's figure: the share of the fixed pairs whose chosen side scores higher (a tie is wrong)."""
    return sum(a > b for a, b in zip(chosen, rejected)) / len(chosen)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoints", nargs="*", help="reward-model checkpoint directories (written by 2-RM.py)")
    p.add_argument("--no-naive-bayes", action="store_true", help="skip the naive-Bayes row")
    p.add_argument("--max_length", type=int, default=128, help="tokens per scored text, as the demo RM trains")
    args = p.parse_args(argv)
    splits = {name: read_preference_pairs([os.path.join(DATA, f"{name}.jsonl")], name) for name in ("test", "val")}
    scorers = []
    if not args.no_naive_bayes:
        train = read_preference_pairs([os.path.join(DATA, "train.jsonl")], "train")
        nb = NaiveBayes([c for _, c, _ in train], [r for _, _, r in train])
        scorers.append(("naive Bayes", lambda prompts, texts: [nb.log_odds(t) for t in texts]))
    for path in args.checkpoints:
        model, tokenizer, _ = load_checkpoint(path, "reward")  # in eval mode

        def scorer(prompts, texts, model=model, tokenizer=tokenizer):
            return score_as_the_stage(model, tokenizer, prompts, texts, args.max_length)

        scorers.append((path, scorer))
    print(f"{'model':40s} {'test acc':>9s} {'test AUC':>9s} {'val acc':>8s} {'val AUC':>8s}")
    for name, score in scorers:
        figures = []
        for pairs in splits.values():
            prompts = [p for p, _, _ in pairs]
            chosen, rejected = score(prompts, [c for _, c, _ in pairs]), score(prompts, [r for _, _, r in pairs])
            figures += [pair_accuracy(chosen, rejected), all_pairs_auc(chosen, rejected)]
        print(f"{name:40s} {figures[0]:9.1%} {figures[1]:9.4f} {figures[2]:8.1%} {figures[3]:8.4f}", flush=True)
    return 0


def score_as_the_stage(model, tokenizer, prompts, texts, max_length):
    """Scores under bf16 autocast where the CPU computes bf16 natively, as 2-RM.py evaluates by default."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=native_bf16()):
        return score_texts(model, tokenizer, prompts, texts, 64, max_length)


if __name__ == "__main__":
    sys.exit(main())
