"""What measuring a rollout costs: full width, the rows grouped by length and cut after their longest answer, and
each prompt read once.

    .venv/bin/python bench/bench_rollout.py --policy checkpoints/sft --prompts data/instructions/train.jsonl
    .venv/bin/python bench/bench_rollout.py --prompts data/sentiment/train.jsonl --max_new_tokens 8 --batch_size 64

Samples one GRPO iteration's answers (``--prompts_count`` prompts x ``--group_size``, up to ``--max_new_tokens``
tokens, bf16 autocast where the CPU has it, as the stages run), then times, on the same answers, in one process:

* the measurement of the rollout: the policy's log-probs and entropy and the reference's log-probs, the old way
  (``response_logits`` over every row at full width, a log-softmax each for the log-probs and the entropy), the
  rows grouped (``rollouts.response_logprobs``: rows sorted by length in groups, cut to length, one log-softmax),
  and the same with each prompt read once for its ``--group_size`` answers (``samples=``, as the stages measure);
* one update pass: forward and backward of every minibatch of ``--batch_size`` random rows at full width, as PPO's
  update runs, and with each prompt of the minibatch read once (``response_logits(..., prompt_of=)``), as GRPO's
  does: the time of each and the largest difference between their gradients, over the largest entry.

Prints the seconds of each, the ratios, and the largest difference from the full-width log-probs and entropies at
real positions.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import types

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # the repository root

import torch
from pipeline_malloc import run_under_pipeline_malloc  # bench/, this script's folder

from chinese_tokenizer import load_tokenizer
from gpt_fast import speed_up
from plumbing.checkpoint import load_checkpoint
from plumbing.cli import ArgumentParser, default_path, positive_int, run
from plumbing.devices import native_bf16
from plumbing.records import read_prompt_files
from plumbing.rollouts import (
    entropy_from_logits,
    response_logits,
    response_logprobs,
    sample_responses,
    token_logprobs,
)


def parse_args(argv=None):
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--policy", default=default_path("checkpoints", "sft"), help="the checkpoint (policy and reference)")
    p.add_argument("--prompts", default=default_path("data", "instructions", "train.jsonl"), help="problems (.jsonl)")
    p.add_argument("--prompts_count", type=positive_int, default=16, help="prompts in the iteration")
    p.add_argument("--group_size", type=positive_int, default=8, help="answers per prompt")
    p.add_argument("--max_new_tokens", type=positive_int, default=100, help="the longest answer in tokens")
    p.add_argument("--batch_size", type=positive_int, default=16, help="rows per update minibatch")
    p.add_argument("--repeats", type=positive_int, default=3, help="timings per way (the best is shown)")
    return p.parse_args(argv)


def best_of(repeats, fn):
    """The fastest of ``repeats`` calls of ``fn`` in seconds, and its last result."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return min(times), out


def main(argv=None):
    args = parse_args(argv)
    cpu = next((line.split(":", 1)[1].strip() for line in subprocess.run(["lscpu"], capture_output=True, text=True)
                .stdout.splitlines() if line.startswith("Model name")), "unknown CPU")
    bf16 = native_bf16()
    print(f"{cpu}, {torch.get_num_threads()} threads, {'bf16 autocast' if bf16 else 'fp32 (no native bf16)'}")
    torch.manual_seed(0)
    tokenizer = load_tokenizer(default_path("data", "tokenizer"))
    policy = load_checkpoint(args.policy, tokenizer)[0].eval()
    ref = load_checkpoint(args.policy, tokenizer)[0].eval()
    speed_up(policy, ref)  # their fast paths on, as the stages run them
    prompts = read_prompt_files([args.prompts], "--prompts")[:args.prompts_count]
    ctx, k = policy.cfg.context_length, args.group_size
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)
    with autocast:
        sequences, attention_mask, response_mask, P = sample_responses(
            policy, prompts, tokenizer, types.SimpleNamespace(max_new_tokens=args.max_new_tokens), ctx, "cpu", k)
    lengths, rows = response_mask.sum(1).float(), len(sequences)
    prompt_lengths = attention_mask[:, :P].sum(1).float()
    print(f"{rows} answers: columns {response_mask.shape[1]}, mean length {lengths.mean():.1f} tokens; prompts "
          f"{P} columns, mean length {prompt_lengths.mean():.1f} tokens")

    @torch.no_grad()
    def full_width():
        responses = sequences[:, P:]
        logits = response_logits(policy, sequences, attention_mask, P)
        ref_logits = response_logits(ref, sequences, attention_mask, P)
        return token_logprobs(logits, responses), token_logprobs(ref_logits, responses), entropy_from_logits(logits)

    def grouped(samples):
        logprobs, entropy = response_logprobs(policy, sequences, attention_mask, response_mask, P, entropy=True,
                                              samples=samples)
        return logprobs, response_logprobs(ref, sequences, attention_mask, response_mask, P, samples=samples), entropy

    def update_pass(shared):
        policy.zero_grad(set_to_none=True)
        order = torch.randperm(rows, generator=torch.Generator().manual_seed(0))
        for start in range(0, rows, args.batch_size):
            idx = order[start:start + args.batch_size]
            logits = response_logits(policy, sequences[idx], attention_mask[idx], P,
                                     prompt_of=idx // k if shared else None)
            logp = token_logprobs(logits, sequences[idx, P:])
            torch.where(response_mask[idx].bool(), logp, 0.0).sum().backward()
        return {name: p.grad for name, p in policy.named_parameters()}

    with autocast:
        t_full, old = best_of(args.repeats, full_width)
        t_grouped, new = best_of(args.repeats, lambda: grouped(1))
        t_once, once = best_of(args.repeats, lambda: grouped(k))
        t_update_full, grads = best_of(args.repeats, lambda: update_pass(False))
        t_update_once, grads_once = best_of(args.repeats, lambda: update_pass(True))
    real = response_mask.bool()
    diff, diff_once = (max((a[real] - b[real]).abs().max().item() for a, b in zip(old, way)) for way in (new, once))
    print(f"measurement (policy log-probs + entropy, reference log-probs): full width {t_full:.2f} s, "
          f"grouped and cut {t_grouped:.2f} s ({t_full / t_grouped:.2f}x), each prompt read once {t_once:.2f} s "
          f"({t_grouped / t_once:.2f}x the grouped); largest difference from full width {diff:.2e} grouped, "
          f"{diff_once:.2e} read once")
    grad_diff = max(((grads[n] - grads_once[n]).abs().max() / grads[n].abs().max()).item()
                    for n in grads if grads[n] is not None and grads[n].any())
    print(f"one update pass (minibatches of {args.batch_size}, forward and backward): full width "
          f"{t_update_full:.2f} s, each prompt read once {t_update_once:.2f} s ({t_update_full / t_update_once:.2f}x); "
          f"largest gradient difference {grad_diff:.1e} of the largest entry")
    return 0


if __name__ == "__main__":
    run_under_pipeline_malloc()  # the stages' allocator setting: what is timed is what the pipeline pays
    run(main)
