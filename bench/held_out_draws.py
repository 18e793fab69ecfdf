"""The preference path's held-out monitors of checkpoints, drawn with a given number of prompts per generate call.

    .venv/bin/python bench/held_out_draws.py --prompts_per_call 16 64

The held-out measurement (``plumbing/held_out.py``) draws the answers of ``MEASURE_PROMPTS`` prompts per call; the
split of the draws into calls decides which random numbers fall on which answer, so it decides the figures. This
bench measures the SFT model and each aligned one on the held-out prompts the aligners use (48 x 4 answers at
temperature 1, seed 1234, fp32), once per ``--prompts_per_call``: 16 prompts a call is the split the preference
path had before the one measurement (64 rows of 16 prompts x 4 answers), 64 the one it has now. Figures as on the
report card: RM score and judge with their standard errors, KL to the SFT model in nats per response, mean length,
the share of answers that end with [SEP], distinct-2.
"""

from __future__ import annotations

import os
import sys
import types

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # the repository root

from chinese_tokenizer import load_tokenizer
from gpt_fast import speed_up
from plumbing import held_out
from plumbing.checkpoint import load_checkpoint
from plumbing.cli import ArgumentParser, default_path, positive_int, run
from plumbing.judge import SentimentJudge
from plumbing.records import read_prompt_files


def parse_args(argv=None):
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoints", default=default_path("checkpoints"),
                   help="folder holding sft, rm, and the aligned ppo, dpo, grpo (those that exist are measured)")
    p.add_argument("--prompts", default=default_path("data", "ppo", "val_prompts.jsonl"), help="held-out prompts")
    p.add_argument("--prompts_per_call", type=positive_int, nargs="+", default=[16, 64],
                   help="prompts per generate call, one measurement each")
    p.add_argument("--tokenizer", default=default_path("data", "tokenizer"), help="tokenizer directory")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    sft, _, _ = load_checkpoint(os.path.join(args.checkpoints, "sft"), "gpt")
    reward_model, _, _ = load_checkpoint(os.path.join(args.checkpoints, "rm"), "reward")
    models = {"sft": sft}
    for name in ("ppo", "dpo", "grpo"):
        if os.path.isfile(os.path.join(args.checkpoints, name, "config.json")):
            models[name] = load_checkpoint(os.path.join(args.checkpoints, name), "gpt")[0]
    for model in (reward_model, *models.values()):
        model.eval()
    speed_up(reward_model, *models.values())
    tokenizer = load_tokenizer(args.tokenizer)
    prompts = read_prompt_files(args.prompts, "--prompts")[:48]
    judge = SentimentJudge()
    settings = types.SimpleNamespace(max_new_tokens=40, seed=1234)
    print("| prompts a call | model | RM score | judge | KL | length | ends with [SEP] | distinct-2 |\n"
          "|---|---|---|---|---|---|---|---|")
    for per_call in args.prompts_per_call:
        held_out.MEASURE_PROMPTS = per_call
        for name, model in models.items():
            rows = held_out.measure(model, sft, prompts, 4, tokenizer, settings, 256, "cpu",
                                    reward_model=reward_model, judge=judge)
            m = held_out.answer_monitors(rows)
            print(f"| {per_call} | {name} | {m['rm_score']:.3f} ± {m['rm_score_se']:.3f} | {m['judge']:.3f} ± "
                  f"{m['judge_se']:.3f} | {m['kl']:.2f} ± {m['kl_se']:.2f} | {m['length']:.1f} | "
                  f"{m['eos_share']:.0%} | {m['distinct_2']:.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    run(main)
