"""Generate text from any stage's checkpoint: one prompt, a file of prompts, or an interactive session.

    python generate.py --prompt "中国的首都是"                     # the furthest stage: ppo, else sft, else pretrain
    python generate.py --checkpoint checkpoints/pretrain --prompt "今天天气" --temperature 0
    python generate.py --prompts_file prompts.jsonl --output answers.jsonl
    python generate.py --reward checkpoints/rm --num_samples 8 --prompt "写一条好评："   # best-of-8 by the RM
    python generate.py                                              # interactive: type a prompt, read the answer

How a prompt becomes model input depends on the checkpoint:

* a pretrain checkpoint (or ``--from_hf`` weights without a chat template, or any checkpoint with ``--raw``)
  continues the prompt's text as
  it is: the ids of the prompt, after the token the model's training documents started with, if any
  (``cfg.bos_id``: ``[CLS]`` for uer's Chinese GPT-2 and what was trained from it; nothing for our own pretraining,
  which joins documents with ``[SEP]`` alone);
* an SFT or PPO checkpoint answers through the chat template it was trained on, ``[CLS] prompt [ANS]``; so does
  an export of one (``load_weight.py --to_hf`` saves the template with its tokenizer) read with ``--from_hf``.

Either way generation stops at ``[SEP]`` (the end of a document in pretraining, the end of an answer after SFT) or
after ``--max_new_tokens``. A prompt longer than the model's context keeps its last tokens (a note goes to
stderr), and a text that grows past it is continued from its last ``context_length`` tokens (noted when
``--max_new_tokens`` alone fills the context).

Output: the generated text alone goes to stdout for ``--prompt`` and in the interactive loop (streamed token by
token; several samples come at the end, separated by a blank line), or
one JSON line per answer, ``{"prompt", "response"}`` plus ``"score"`` with ``--reward``, for ``--prompts_file``;
everything else (which checkpoint, truncation notes, the scores of all samples) goes to stderr.

Sampling: ``--temperature 0`` is greedy decoding; otherwise softmax sampling after ``--top_k`` / ``--top_p`` filtering
and ``--repetition_penalty``. The ``--num_samples`` samples of one prompt are drawn in one batched ``generate`` call.
Each prompt of ``--prompt``/``--prompts_file`` starts from the generator seeded with a hash of ``--seed`` and the prompt
(``prompt_seed``), so an answer in a file run is the answer the same prompt gets alone and no two prompts share their
random draws (best-of-n's samples are independent across prompts); the interactive session is seeded once, so asking
again gives a new sample. With ``--reward DIR`` each sample is scored by the reward model on ``[CLS] prompt [ANS]
response [SEP]`` (the text it was trained on) and the best one is kept (best-of-n). ``--monitors FILE`` then writes, for
best-of-k with k = 1, 2, 4, ... up to n (the best of each prompt's first k samples, so one run of n samples measures
every k), the monitors of the kept answers (``judge.summarize``: RM score, the independent judge, distinct-2, longest
repeated run, share ending with [SEP], length) and best-of-k's KL to the sampling model, ``log k - (k - 1) / k``: the
no-training baselines that the alignment stages' held-out monitors are compared with.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time

import torch

from chinese_tokenizer import EOS_ID, IncrementalDecoder, decode, until_eos
from gpt_fast import generate, speed_up
from plumbing.cli import (
    ArgumentParser,
    UserError,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
    probability,
    run,
)
from plumbing.devices import pick_device
from plumbing.flops import FlopCounter, format_speed, speed_record
from plumbing.inference import (
    DTYPES,
    add_dtype_argument,
    add_model_arguments,
    check_reward_dir,
    load_policy,
    load_reward,
    log,
    prompt_to_ids,
    weight_dtype,
)
from plumbing.reward import score_texts

EXIT_WORDS = ("exit", "quit")


def parse_args(argv=None):
    p = ArgumentParser(description="Generate text from a stage checkpoint (pretrain, SFT, PPO, DPO or GRPO).")
    add_model_arguments(p)
    prompts = p.add_mutually_exclusive_group()
    prompts.add_argument("--prompt", help="generate for this one prompt and print the answer")
    prompts.add_argument("--prompts_file", help="a file of prompts: one per line, or .jsonl/.json/.parquet records "
                                                "with a \"prompt\" (or alpaca / \"messages\" records, as 3-PPO.py "
                                                "reads them)")
    p.add_argument("--output", help="where --prompts_file answers go as JSON lines (default: stdout)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --output file")
    p.add_argument("--system", help="a system text before each prompt of a chat checkpoint ([CLS] system [SEP] "
                                    "prompt [ANS]), e.g. the one it was fine-tuned with (1-SFT.py --system)")
    p.add_argument("--raw", action="store_true",
                   help="continue the prompt text as is, even for a chat (SFT/PPO/DPO/GRPO) checkpoint")
    p.add_argument("--max_new_tokens", type=positive_int, default=100, help="most tokens generated per answer")
    p.add_argument("--temperature", type=non_negative_float, default=0.8, help="0 means greedy decoding")
    p.add_argument("--top_k", type=non_negative_int, default=50, help="sample among the k likeliest tokens (0: all)")
    p.add_argument("--top_p", type=probability, default=1.0, help="nucleus sampling threshold (1: off)")
    p.add_argument("--repetition_penalty", type=positive_float, default=1.0,
                   help="> 1 makes tokens already in the text less likely (1: off)")
    p.add_argument("--seed", type=int, default=1234, help="seed for sampling")
    p.add_argument("--num_samples", type=positive_int, default=1,
                   help="samples per prompt, drawn as one batch (all are printed; with --reward only the "
                        "best); each step draws one random number per row, so past its first token the first of 4 "
                        "samples is not the one sample that --num_samples 1 gives")
    p.add_argument("--reward", help="reward model checkpoint (from 2-RM.py): keep the best-scoring sample")
    p.add_argument("--monitors", help="with --prompts_file and --reward: write the monitors (RM score, judge, "
                                      "distinct-2, ...) of best-of-k for k = 1, 2, 4, ... n to this JSON file")
    p.add_argument("--device", help="torch device (default: cuda if available, else cpu)")
    add_dtype_argument(p)
    args = p.parse_args(argv)
    if args.output and not args.prompts_file:
        raise UserError("--output is only used with --prompts_file; drop it or give --prompts_file")
    if args.monitors and not (args.prompts_file and args.reward):
        raise UserError("--monitors needs --prompts_file and --reward (it describes the best-of-n answers)")
    return args


# --- one prompt (the model is loaded by plumbing/inference.py, which serve.py shares) ----------------------------


def check_prompt(prompt: str, where: str) -> str:
    if not prompt.strip():
        raise UserError(f"{where} is empty; give some text to continue")
    return prompt


def prompt_seed(seed: int, prompt) -> int:
    """The seed a prompt's samples are drawn with: a hash of ``seed`` and the prompt (text or conversation), so the
    same prompt gets the same answer alone or anywhere in a file, and different prompts get independent draws."""
    text = prompt if isinstance(prompt, str) else json.dumps(prompt, ensure_ascii=False)
    digest = hashlib.sha256(f"{seed}\0{text}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1  # 63 bits: any value torch.manual_seed takes


def sample(model, ids: list[int], args, num_samples: int, stream=None) -> list[list[int]]:
    """``num_samples`` continuations of ``ids`` in one batched ``generate`` call, each cut at its first ``[SEP]``."""
    device = next(model.parameters()).device
    idx = torch.tensor([ids] * num_samples, dtype=torch.long, device=device)  # (n, T)
    out = generate(model, idx, args.max_new_tokens, model.cfg.context_length, temperature=args.temperature,
                   top_k=args.top_k or None, top_p=args.top_p if args.top_p < 1.0 else None, eos_id=EOS_ID,
                   repetition_penalty=args.repetition_penalty, stream=stream)  # (n, T + new)
    return [until_eos(row) for row in out[:, len(ids):].tolist()]


@torch.no_grad()
def score(reward_model, tokenizer, prompt: str, responses: list[str], ended: list[bool]) -> list[float]:
    """The reward model's score of each ``[CLS] prompt [ANS] response [SEP]``, in one right-padded batch; a
    response cut off at ``--max_new_tokens`` (``ended`` False) without the ``[SEP]`` it never wrote, as PPO, DPO
    and GRPO score their held-out answers, so that best-of-n and they are measured alike."""
    return score_texts(reward_model, tokenizer, [prompt] * len(responses), responses, ended=ended)


class TextStream:
    """A ``stream`` callback for ``generate`` that writes one row's text as its tokens arrive (through
    ``IncrementalDecoder``, so word pieces come out right), up to its first ``[SEP]``."""

    def __init__(self, tokenizer, out):
        self.decoder, self.out, self.done = IncrementalDecoder(tokenizer), out, False

    def __call__(self, next_ids):  # (B,) with B == 1
        token = int(next_ids[0])
        if self.done or token == EOS_ID:
            self.done = True
            return
        new = self.decoder.push(token)
        if new:
            self.out.write(new)
            self.out.flush()


def answer(prompt: str, model, tokenizer, chat: bool, args, reward_model=None, out=None, kept=None) -> list[dict]:
    """Generate for one prompt. Returns rows ``{"prompt", "response"}``: the best sample with its ``"score"`` when
    there is a reward model, else one row per sample. With ``out``, a single sample is streamed to it as it grows.
    With a reward model and a list ``kept``, the list of every sample's ``{"ids", "ended", "response", "score"}``
    is appended to it (for ``--monitors``)."""
    ids = prompt_to_ids(prompt, tokenizer, chat, model.cfg.context_length, model.cfg.bos_id, args.system)
    n = args.num_samples
    stream = TextStream(tokenizer, out) if out is not None and n == 1 and reward_model is None else None
    samples = sample(model, ids, args, n, stream)
    responses = [decode(r, tokenizer) for r in samples]
    if reward_model is None:
        return [{"prompt": prompt, "response": r} for r in responses]
    ended = [len(ids) < args.max_new_tokens for ids in samples]  # shorter than the limit: it stopped at [SEP]
    scores = score(reward_model, tokenizer, prompt, responses, ended)
    best = max(range(n), key=lambda i: scores[i])  # the first of equal scores
    for i, (r, s) in enumerate(zip(responses, scores)):
        log(f"{'*' if i == best else ' '} sample {i + 1}: score {s:+.4f}  {r!r}")
    if kept is not None:
        kept.append([{"ids": ids, "ended": e, "response": r, "score": s}
                     for ids, e, r, s in zip(samples, ended, responses, scores)])
    return [{"prompt": prompt, "response": responses[best], "score": scores[best]}]


def write_monitors(path: str, samples: list[list[dict]], n: int, speed: dict) -> dict:
    """``--monitors``: for k = 1, 2, 4, ... and n, ``judge.summarize`` of the best of each prompt's first k samples
    (``samples``: one list of n sample dicts per prompt, from ``answer``), plus ``best_of_n`` (k) and ``kl_bound``
    (best-of-k's KL to the sampling model, nats per response). Returns ``{str(k): monitors}``, and writes it with
    ``"speed"``: ``speed`` (``flops.speed_record`` of the sampling and scoring)."""
    from plumbing.judge import SentimentJudge, best_of_n_kl, summarize

    judge, result = SentimentJudge(), {}
    for k in sorted({2 ** i for i in range(n.bit_length()) if 2 ** i <= n} | {n}):
        kept = [max(prompt[:k], key=lambda sample: sample["score"]) for prompt in samples]  # first of equal scores
        monitors = summarize([s["ids"] for s in kept], [s["ended"] for s in kept], [s["score"] for s in kept],
                             judge([s["response"] for s in kept]))
        result[str(k)] = {**monitors, "best_of_n": k, "kl_bound": best_of_n_kl(k)}
    with open(path, "w", encoding="utf-8") as f:
        json.dump({**result, "speed": speed}, f, indent=1)
    return result


# --- the three modes -------------------------------------------------------------------------------------------

def read_prompts(path: str) -> list:
    """Prompts from a text file (one per line; blank lines skipped) or from .jsonl / .json / .parquet records read
    as the alignment stages read theirs (``records.prompt_of``: {"prompt"}, alpaca or "messages" records; a
    conversation comes back as a tuple of turns)."""
    from plumbing.records import read_prompt_files, read_prompt_lines

    if path.endswith((".jsonl", ".json", ".parquet")):
        return read_prompt_files(path, "--prompts_file")
    return read_prompt_lines(path, "--prompts_file", one_per="answer")


def print_answer(prompt: str, model, tokenizer, chat: bool, args, reward_model=None) -> None:
    """Write the answer to stdout: streamed when it is one sample, else the samples (or the best) when done,
    separated by blank lines."""
    rows = answer(prompt, model, tokenizer, chat, args, reward_model, out=sys.stdout)
    if reward_model is not None or args.num_samples > 1:  # nothing was streamed
        print("\n\n".join(row["response"] for row in rows), end="")
    print(flush=True)


def interactive(model, tokenizer, chat: bool, args, reward_model=None) -> None:
    """Read prompts from stdin until EOF or "exit"; stream each answer to stdout."""
    log(f"type a prompt and press Enter; {' or '.join(EXIT_WORDS)} (or Ctrl-D) ends")
    torch.manual_seed(args.seed)
    while True:
        if sys.stdin.isatty():
            sys.stderr.write("> ")
            sys.stderr.flush()
        try:
            line = sys.stdin.readline()
        except KeyboardInterrupt:
            line = ""
        if not line or line.strip() in EXIT_WORDS:
            break
        prompt = line.rstrip("\n")
        if not prompt.strip():
            continue
        print_answer(prompt, model, tokenizer, chat, args, reward_model)


def main(argv=None):
    args = parse_args(argv)
    if args.prompt is not None:
        check_prompt(args.prompt, "--prompt")
    prompts = read_prompts(args.prompts_file) if args.prompts_file else None
    if args.output and os.path.dirname(args.output) and not os.path.isdir(os.path.dirname(args.output)):
        raise UserError(f"--output {args.output}: folder {os.path.dirname(args.output)} does not exist; create it")
    if args.output and os.path.exists(args.output):
        if os.path.realpath(args.output) == os.path.realpath(args.prompts_file):
            raise UserError(f"--output {args.output} is the --prompts_file itself; write the answers elsewhere")
        if not args.overwrite:
            raise UserError(f"--output {args.output} already exists; pass --overwrite to replace it or choose "
                            f"another file")
    if args.monitors and os.path.exists(args.monitors) and not args.overwrite:
        raise UserError(f"--monitors {args.monitors} already exists; pass --overwrite to replace it or choose "
                        f"another file")
    if args.temperature == 0 and args.num_samples > 1:
        log(f"note: --temperature 0 is greedy, so the {args.num_samples} samples will be the same")

    if args.reward:
        check_reward_dir(args.reward)

    device = pick_device(args.device)
    model, tokenizer, chat = load_policy(args)
    speed_up(model)  # the same model, its decoding paths fast (gpt_fast.py)
    if prompts and not chat and not all(isinstance(p, str) for p in prompts):
        raise UserError("a conversation in --prompts_file needs a chat checkpoint (SFT/PPO/DPO/GRPO) without --raw; "
                        "give plain prompts to continue")
    if args.system and not chat:
        raise UserError("--system and --raw do not go together: --raw continues the text as is; drop one" if args.raw
                        else "--system is for chat checkpoints (SFT/PPO/DPO/GRPO), and this model only continues "
                             "text (a pretrain checkpoint or --from_hf weights); drop --system")
    model.to(device=device, dtype=DTYPES[args.dtype])
    reward_model = speed_up(load_reward(args.reward, model.cfg.vocab_size).to(device)) if args.reward else None
    log(f"device {device}, {weight_dtype(model)} weights; {sum(p.numel() for p in model.parameters()):,} "
        f"parameters; context {model.cfg.context_length} tokens")
    flop_counter, started = FlopCounter(model, reward_model), time.perf_counter()  # every pass the answers take
    if args.max_new_tokens >= model.cfg.context_length:
        log(f"note: a prompt and --max_new_tokens {args.max_new_tokens} are longer than the model's context of "
            f"{model.cfg.context_length} tokens; past it, each new token sees only the last {model.cfg.context_length}")

    if args.prompt is not None:
        torch.manual_seed(prompt_seed(args.seed, args.prompt))
        print_answer(args.prompt, model, tokenizer, chat, args, reward_model)
    elif prompts is not None:
        try:
            out = open(args.output, "w", encoding="utf-8") if args.output else sys.stdout
        except OSError as e:
            raise UserError(f"--output {args.output}: cannot write ({e.strerror}); choose another path") from e
        kept = [] if args.monitors else None
        try:
            for i, prompt in enumerate(prompts, start=1):
                torch.manual_seed(prompt_seed(args.seed, prompt))
                for row in answer(prompt, model, tokenizer, chat, args, reward_model, kept=kept):
                    out.write(json.dumps(row, ensure_ascii=False) + "\n")
                out.flush()
                log(f"[{i}/{len(prompts)}] done")
        finally:
            if out is not sys.stdout:
                out.close()
        if args.output:
            log(f"wrote {args.output}")
        speed = speed_record(flop_counter.flops, time.perf_counter() - started, device, next(model.parameters()).dtype)
        log(f"the answers took {sum(speed['flops'].values()):.3g} FLOPs: {format_speed(speed)}")
        if args.monitors:
            for k, m in write_monitors(args.monitors, kept, args.num_samples, speed).items():
                log(f"best-of-{k}: RM score {m['rm_score']:.3f}, judge {m['judge']:.3f} ± {m['judge_se']:.3f}, "
                    f"distinct-2 {m['distinct_2']:.3f}, ends with [SEP] {m['eos_share']:.0%}, KL <= "
                    f"{m['kl_bound']:.2f}")
            log(f"wrote {args.monitors}")
    else:
        interactive(model, tokenizer, chat, args, reward_model)
    return 0


if __name__ == "__main__":
    run(main)
