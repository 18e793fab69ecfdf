"""The counting baselines on the project's own splits, in seconds (see ``baselines.py`` for the models).

    .venv/bin/python bench/baselines.py    # token bigrams on data/pretrain and data/sft, naive Bayes on data/rm
    .venv/bin/python bench/baselines.py --block_len 256 --eval_examples 48   # the blocks of an older demo

Pretraining: the bigram is fitted on the --train_files token stream (documents joined by [SEP], as
``token_cache.PackedBlocks`` joins them) and scored on the --val_files predictions that 0-PRETRAIN's validation loss
uses:
every whole block of --block_len predictions, and the evenly spread subset of --eval_examples blocks that the stage
evaluates (``training.spread_subset``). SFT: a bigram counted on the --sft_train responses' predictions (the ``[ANS]``
before the first response token, each response token before the next, the last before ``[SEP]``), scored on the response
tokens of the --sft_val pairs, all of them and 1-SFT's --sft_eval_examples subset. Reward model: naive Bayes fitted on
the --rm_train pairs (chosen = good, rejected = bad), pair accuracy on the --rm_test pairs. Deterministic: nothing is
sampled.
"""

from __future__ import annotations

import os
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)  # first, so that `import baselines` is the repository's module and not this script
from plumbing.baselines import BigramLM, NaiveBayes, pair_accuracy, unigram_cross_entropy
from plumbing.cli import ArgumentParser, default_path, positive_int, run


def parse_args(argv=None):
    p = ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 2)[2])
    p.add_argument("--train_files", nargs="+", default=[default_path("data", "pretrain", "train.jsonl")],
                   help="documents the bigram is counted on (as 0-PRETRAIN reads them)")
    p.add_argument("--val_files", nargs="+", default=[default_path("data", "pretrain", "val.jsonl")],
                   help="documents whose next-token predictions are scored")
    p.add_argument("--tokenizer", default=default_path("data", "tokenizer"), help="tokenizer directory")
    p.add_argument("--block_len", type=positive_int, default=128,
                   help="predictions per block (0-PRETRAIN's --context_length for the demo)")
    p.add_argument("--eval_examples", type=positive_int, default=96, help="0-PRETRAIN's demo --eval_examples")
    p.add_argument("--sft_train", nargs="+", default=[default_path("data", "sft", "train.jsonl")],
                   help="{prompt, response} pairs whose responses the SFT bigram is counted on")
    p.add_argument("--sft_val", nargs="+", default=[default_path("data", "sft", "val.jsonl")],
                   help="pairs whose response tokens are scored")
    p.add_argument("--sft_eval_examples", type=positive_int, default=200, help="1-SFT's --eval_examples")
    p.add_argument("--sft_max_length", type=positive_int, default=256,
                   help="1-SFT's --max_length (the demo model's context_length): longer pairs are cut as SFT cuts them")
    p.add_argument("--rm_train", default=default_path("data", "rm", "train.jsonl"),
                   help="{prompt, chosen, rejected} pairs the naive Bayes is counted on")
    p.add_argument("--rm_test", default=default_path("data", "rm", "test.jsonl"), help="pairs scored")
    p.add_argument("--skip", choices=["lm", "sft", "rm"], nargs="+", default=[], help="leave out some baselines")
    return p.parse_args(argv)


def language_model(args) -> None:
    from chinese_tokenizer import VOCAB_SIZE, load_tokenizer
    from plumbing.batching import spread_subset
    from plumbing.documents import load_text_documents
    from plumbing.token_cache import PackedBlocks

    started = time.time()
    tokenizer = load_tokenizer(args.tokenizer)
    train = PackedBlocks(load_text_documents(args.train_files, "--train_files"), tokenizer, args.block_len, "train")
    val = PackedBlocks(load_text_documents(args.val_files, "--val_files"), tokenizer, args.block_len, "val")
    bigram = BigramLM(train.tokens, VOCAB_SIZE)
    subset = spread_subset(len(val), args.eval_examples)
    print(f"token LM: train {len(train.tokens):,} tokens; val {len(val)} blocks of {args.block_len} predictions "
          f"({len(val) * args.block_len:,}); Kneser-Ney discount {bigram.discount:.3f} (from train counts)")
    for name, blocks in ((f"all {len(val)} val blocks", None), (f"the stage's {len(subset)} eval blocks", subset)):
        uni = unigram_cross_entropy(train.tokens, val.tokens, args.block_len, VOCAB_SIZE, blocks)
        bi = bigram.cross_entropy(val.tokens, args.block_len, blocks)
        print(f"  {name:<28} add-one unigram {uni:.3f} nats/token, interpolated KN bigram {bi:.3f} nats/token")
    print(f"  ({time.time() - started:.1f} s)")


def sft_responses(args) -> None:
    from chinese_tokenizer import VOCAB_SIZE, load_tokenizer
    from plumbing.baselines import chat_predictions
    from plumbing.batching import ChatPairs, spread_subset
    from plumbing.records import read_chat_pairs

    started = time.time()
    tokenizer = load_tokenizer(args.tokenizer)

    train = ChatPairs(read_chat_pairs(args.sft_train, "--sft_train"), tokenizer, args.sft_max_length)
    val = ChatPairs(read_chat_pairs(args.sft_val, "--sft_val"), tokenizer, args.sft_max_length)
    previous, target = chat_predictions(train)
    bigram = BigramLM.from_pairs(previous, target, VOCAB_SIZE)
    print(f"SFT responses: {len(train)} train pairs, {len(previous):,} response predictions; KN discount "
          f"{bigram.discount:.3f}")
    subset = spread_subset(len(val), args.sft_eval_examples)
    for name, indices in ((f"all {len(val)} val pairs", None), (f"the stage's {len(subset)} eval pairs", subset)):
        print(f"  {name:<28} response bigram {bigram.pair_cross_entropy(*chat_predictions(val, indices)):.3f} "
              f"nats/token")
    print(f"  ({time.time() - started:.1f} s)")


def reward_model(args) -> None:
    from plumbing.records import read_jsonl

    started = time.time()
    train = read_jsonl(args.rm_train, ("prompt", "chosen", "rejected"))
    test = read_jsonl(args.rm_test, ("prompt", "chosen", "rejected"))
    nb = NaiveBayes([r["chosen"] for r in train], [r["rejected"] for r in train])
    accuracy = pair_accuracy(nb, [(r["chosen"], r["rejected"]) for r in test])
    print(f"reward: char uni+bigram naive Bayes (add-one) on {len(train)} train pairs: test pair accuracy "
          f"{100 * accuracy:.1f}% of {len(test)} pairs ({time.time() - started:.1f} s)")


def main(argv=None):
    args = parse_args(argv)
    for name, baseline in (("lm", language_model), ("sft", sft_responses), ("rm", reward_model)):
        if name not in args.skip:
            baseline(args)
    return 0


if __name__ == "__main__":
    run(main)
