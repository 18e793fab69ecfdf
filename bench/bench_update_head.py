"""What the output head costs an RL update: the full-vocabulary log-softmax of the sampled tokens against the chunked
cross-entropy that pretraining uses, on a GRPO minibatch's shape.

    .venv/bin/python bench/bench_update_head.py --preset demo --rows 64 --prompt 26 --answer 64

One forward and backward pass of the demo model on ``--rows`` sequences of ``--prompt`` + ``--answer`` tokens, the
way ``3-GRPO.py``'s ``grpo_update`` computes its log-probs: the head on the last answer + 1 positions
(``logits_to_keep``), ``token_logprobs`` (a float32 log-softmax over the 21,128 ids, then the sampled token's entry)
and their sum as the loss. Against it, with the same body: the head and cross-entropy of ``gpt_fast``'s
``chunked_next_token_loss`` with the sampled tokens as labels (the same FLOPs, a log-prob is minus that
cross-entropy, without the (rows x answer x 21,128) logits in memory), and the body alone (no head). Each variant is
timed ``--rounds`` times after a warm-up; the median, in ms, on this CPU with its threads.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # the repository root

import torch
from pipeline_malloc import run_under_pipeline_malloc  # bench/, this script's folder

from gpt_fast import chunked_next_token_loss, speed_up
from gpt_model import GPTModel, get_preset
from plumbing.cli import ArgumentParser, positive_int, run
from plumbing.rollouts import token_logprobs


def parse_args(argv=None):
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="demo", help="model size (gpt_model.PRESETS), random weights")
    p.add_argument("--rows", type=positive_int, default=64, help="sequences per minibatch (GRPO's demo: 64)")
    p.add_argument("--prompt", type=positive_int, default=26, help="prompt tokens")
    p.add_argument("--answer", type=positive_int, default=64, help="answer tokens")
    p.add_argument("--rounds", type=positive_int, default=5, help="timed passes per variant (the median is shown)")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    torch.manual_seed(0)
    model = speed_up(GPTModel(get_preset(args.preset)).eval())
    ids = torch.randint(0, model.cfg.vocab_size, (args.rows, args.prompt + args.answer))
    answer = ids[:, args.prompt:]  # (b, R)
    labels = torch.full_like(ids, -100)
    labels[:, args.prompt - 1:-1] = answer  # position P - 1 + j predicts answer token j

    def full_vocabulary():
        logits = model(ids, logits_to_keep=args.answer + 1)["logits"][:, :-1]  # (b, R, V)
        (-token_logprobs(logits, answer).sum()).backward()

    def chunked():
        hidden = model.hidden_states(ids)[0]  # (b, T, E)
        chunked_next_token_loss(hidden, model.out_head.weight, labels).backward()

    def body_alone():
        model.hidden_states(ids)[0][:, args.prompt - 1:-1].float().pow(2).mean().backward()

    print(f"CPU threads {torch.get_num_threads()}; {args.preset}, {args.rows} rows of {args.prompt} + {args.answer} "
          f"tokens, forward and backward, median of {args.rounds}\n\n| variant | ms |\n|---|---|")
    for name, step in (("full-vocabulary log-softmax (token_logprobs)", full_vocabulary),
                       ("chunked cross-entropy (chunked_next_token_loss)", chunked), ("the body alone", body_alone)):
        step()
        model.zero_grad()
        times = []
        for _ in range(args.rounds):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
            model.zero_grad()
        print(f"| {name} | {statistics.median(times) * 1e3:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    run_under_pipeline_malloc()  # the stages' allocator setting: what is timed is what the pipeline pays
    run(main)
