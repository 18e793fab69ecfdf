"""How good the reviews are that checkpoints write under the review instructions, on the 好评 and the 差评 side.

    .venv/bin/python bench/review_quality.py --policies checkpoints/sft checkpoints/grpo-tasks

The verifier checks an instruction's limit, not the review: GRPO with it alone shortened the answers and sometimes
wrote worse ones. The report card scores the 好评 answers only, with the RM and the judge (both score how positive a
review is). This bench adds the other side: on a 差评 problem a lower score is the better answer, so a policy that
answers every review instruction with praise shows here as a 差评 judge that rose. For each checkpoint and each side,
``--samples`` answers per held-out problem at temperature 1: the share the strict checker accepts, the mean length
in characters, the RM score and the judge's P(positive), each the mean over problems of the problem's mean, ± its
standard error over problems. The same seed draws the same samples for the same weights.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # the repository root

import torch

from chinese_tokenizer import EOS_ID, chat_prompt_ids, load_tokenizer
from gpt_fast import generate, speed_up
from plumbing.batching import pad_left
from plumbing.checkpoint import load_checkpoint, read_config
from plumbing.cli import ArgumentParser, UserError, default_path, positive_int, run
from plumbing.judge import SentimentJudge, mean_and_se
from plumbing.records import read_tasks
from plumbing.rollouts import response_mask_after
from plumbing.tasks import generated_answers, review_polarity, solved


def parse_args(argv=None):
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--policies", nargs="+", default=[default_path("checkpoints", "sft")],
                   help="the checkpoints to measure")
    p.add_argument("--reward", default=default_path("checkpoints", "rm"), help="the reward model that scores")
    p.add_argument("--tasks", default=default_path("data", "instructions", "test.jsonl"), help="problem file")
    p.add_argument("--samples", type=positive_int, default=4, help="answers per problem at temperature 1")
    p.add_argument("--max_new_tokens", type=positive_int, default=64, help="the longest answer in tokens")
    p.add_argument("--batch", type=positive_int, default=50, help="problems per generate call")
    p.add_argument("--seed", type=int, default=0, help="torch's seed for the samples of each checkpoint")
    return p.parse_args(argv)


@torch.no_grad()
def measure(model, reward_model, judge, tasks, tokenizer, args) -> dict:
    """{side: {figure: per-problem means}} for the sides "好评" and "差评" of ``tasks``."""
    ctx = min(model.cfg.context_length, reward_model.cfg.context_length)
    if args.max_new_tokens > ctx - 3:
        raise UserError(f"--max_new_tokens {args.max_new_tokens} leaves no room for a prompt in a context of {ctx} "
                        f"(the shorter of the policy's and --reward's); lower it")
    figures = {side: {"right": [], "chars": [], "rm": [], "judge": []} for side in ("好评", "差评")}
    for i in range(0, len(tasks), args.batch):
        batch = tasks[i:i + args.batch]
        prompt = pad_left([chat_prompt_ids(t["prompt"], tokenizer, ctx - args.max_new_tokens) for t in batch])
        ids, mask = prompt["input_ids"], prompt["attention_mask"]  # (b, P)
        out = generate(model, ids, args.max_new_tokens, ctx, temperature=1.0, eos_id=EOS_ID, attention_mask=mask,
                       num_samples=args.samples)  # (b * samples, P + R)
        P = ids.shape[1]
        texts, ended, _ = generated_answers(out, P, tokenizer)
        full = torch.cat([mask.repeat_interleave(args.samples, 0), response_mask_after(out[:, P:], EOS_ID)], 1)
        rm = reward_model(out, full)["rewards"].float().view(len(batch), args.samples)  # (b, samples)
        p_positive = torch.tensor(judge([x or "" for x in texts])).view(len(batch), args.samples)  # (b, samples)
        for j, t in enumerate(batch):
            side = figures["好评" if review_polarity(t) == 1 else "差评"]
            rows = range(j * args.samples, (j + 1) * args.samples)
            side["right"].append(sum(solved(t, texts[r], ended[r]) for r in rows) / args.samples)
            side["chars"].append(sum(len(texts[r] or "") for r in rows) / args.samples)
            side["rm"].append(rm[j].mean().item())
            side["judge"].append(p_positive[j].mean().item())
    return {side: f for side, f in figures.items() if f["rm"]}  # a side with no problems is left out


def check_checkpoint(path: str, flag: str, reward: bool) -> None:
    """A one-line ``UserError`` naming ``flag`` unless ``path`` holds a checkpoint of the right kind (a reward model
    when ``reward``, else a language model): checked before anything is measured."""
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise UserError(f"{flag} {path}: no checkpoint there (no config.json); give the folder of a stage's "
                        f"checkpoint, e.g. checkpoints/{'rm' if reward else 'sft'}")
    if (read_config(path).get("model_type") == "reward") != reward:
        raise UserError(f"{flag} {path} is {'not ' if reward else ''}a reward model; give the language models as "
                        f"--policies and the RM (2-RM.py) as --reward")


def main(argv=None):
    args = parse_args(argv)
    tasks = [t for t in read_tasks(args.tasks, "--tasks") if review_polarity(t)]
    if not tasks:
        raise UserError(f"--tasks {args.tasks} holds no review instruction (a 好评 or 差评 problem of the instruction "
                        f"family); give data/instructions/test.jsonl or another file of them")
    check_checkpoint(args.reward, "--reward", reward=True)
    for path in args.policies:
        check_checkpoint(path, "--policies", reward=False)
    tokenizer = load_tokenizer(default_path("data", "tokenizer"))
    reward_model = speed_up(load_checkpoint(args.reward, "reward", flag="--reward")[0].eval())
    judge = SentimentJudge()
    print(f"{len(tasks)} review instructions of {args.tasks}, {args.samples} samples each at temperature 1")
    print("| checkpoint | side | problems | kept | mean characters | RM score | judge P(positive) |")
    print("|---|---|---|---|---|---|---|")
    for path in args.policies:
        start = time.time()
        model = speed_up(load_checkpoint(path, "gpt", flag="--policies")[0].eval())
        torch.manual_seed(args.seed)
        for side, f in measure(model, reward_model, judge, tasks, tokenizer, args).items():
            (rm, rm_se), (p, p_se) = mean_and_se(f["rm"]), mean_and_se(f["judge"])
            print(f"| {path} | {side} | {len(f['rm'])} | {sum(f['right']) / len(f['right']):.1%} | "
                  f"{sum(f['chars']) / len(f['chars']):.1f} | {rm:.3f} ± {rm_se:.3f} | {p:.3f} ± {p_se:.3f} |")
        print(f"  ({path}: {time.time() - start:.0f} s)", flush=True)


if __name__ == "__main__":
    run(main)
