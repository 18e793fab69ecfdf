"""The held-out measurement of the alignment stages (3-PPO.py, 3-DPO.py, 3-GRPO.py), one for both paths.

A policy answers held-out prompts; each answer becomes one row (``measure``); a path's summary turns the rows into
figures and its flag compares the aligned policy's figures with the SFT policy's:

* the preference path (a reward model): ``answer_monitors``, the RM score beside the independent judge, KL,
  entropy, length, ``[SEP]`` share and repetition (``judge.py``), and ``judge.reward_hacking_flag``;
* the verifiable path (``--verifier``): ``tasks.task_monitors``, exact accuracy greedy and sampled with pass@k, per
  family, and ``tasks.task_hacking_flag``.

Everything else is one story for both (``HeldOut``): the SFT policy before any update, the policy now and then,
the aligned policy at the end, each measured in eval mode under the stage's autocast, with a fixed seed so every
policy is compared on the same draws, printed on one line and recorded in the metrics rows (``val_*``) and in
the stage's results (``held_out``, ``held_out_settings``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch

from chinese_tokenizer import EOS_ID
from gpt_fast import generate
from plumbing.checkpoint import weights_digest
from plumbing.devices import forked_rng
from plumbing.flops import counting_as
from plumbing.judge import KL_LIMIT, reward_hacking_flag, summarize
from plumbing.markdown import markdown_table
from plumbing.records import shown_prompt
from plumbing.rollouts import each, kl_per_response, prompt_text, response_logprobs, sample_responses
from plumbing.tasks import (
    asks_for_praise,
    describe_tasks,
    generated_answers,
    solved,
    task_hacking_flag,
    task_monitors,
)
from plumbing.verifiers import VERIFIERS, contains

MEASURE_PROMPTS = 64  # prompts per generate call of a measurement (times its samples per prompt rows)
READ_SAMPLES = 4  # the first answers of each prompt read in depth: their KL and entropy, RM score and judge
SFT_SAMPLES = 16  # answers per problem of the SFT policy on the verifiable path: its pass@16 is best-of-16
# Measurements already made in this process, by everything that decides them (``measure``). The pipeline runs PPO,
# DPO and GRPO in one process, and each starts by measuring the same SFT policy on the same draws.
_MEASURED: dict = {}


def scored(prompt) -> bool:
    """Whether the reward model and the judge read the answers to ``prompt``: every preference prompt, and the
    problems that ask for a 好评 (both score how positive a review is; on any other problem that says nothing)."""
    return not isinstance(prompt, dict) or asks_for_praise(prompt)


@torch.no_grad()
def measure(policy, ref, prompts, samples: int, tokenizer, args, context_length: int, device, *, reward_model=None,
            judge=None, verifier: str | None = None) -> list[dict]:
    """``samples`` sampled answers (temperature 1, seed ``args.seed``) to each of ``prompts``, and for verifiable
    problems (dicts, ``records.read_tasks``) one greedy answer too, each made one row:

    ``prompt`` (its index), ``sample`` (0 .. samples - 1, or -1 for the greedy one), ``ids`` (the response's token
    ids, [SEP] removed), ``text`` (None where a special token stands in it), ``ended``; on the first
    ``READ_SAMPLES`` samples of each prompt ``kl`` (nats, against ``ref``; exactly 0 when the weights are the same)
    and ``entropy``, ``tokens`` (the summed entropy and the tokens it is summed over), and where the prompt is
    ``scored`` and the models are given, ``rm_score`` and ``judge``; on problems, ``right`` (the strict checker,
    ``tasks.solved``) and ``lax`` (``verifier`` when that is the lax one, else ``verifiers.contains``).

    The answers are drawn as every stage draws them (``rollouts.sample_responses``'s way: k rows per prompt from
    one reading of it), ``MEASURE_PROMPTS`` prompts per call. A measurement this process has made already (same
    weights, prompts and settings) is returned again.
    """
    kind = torch.device(device).type
    autocast = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None
    models = (policy, ref) if reward_model is None else (policy, ref, reward_model)
    key = (weights_digest(*models), type(judge).__name__, repr(list(prompts)), samples, args.max_new_tokens,
           context_length, str(device), args.seed, verifier, str(autocast), MEASURE_PROMPTS)
    if key not in _MEASURED:
        same = weights_digest(policy) == weights_digest(ref)
        with forked_rng(device), counting_as("held_out"):  # its FLOPs apart from the stage's own
            torch.manual_seed(args.seed)
            _MEASURED[key] = [row for start in range(0, len(prompts), MEASURE_PROMPTS)
                              for row in _answer(policy, None if same else ref, prompts, start, samples, tokenizer,
                                                 args, context_length, device, reward_model, judge, verifier)]
    return copy.deepcopy(_MEASURED[key])


def _answer(policy, ref, prompts, start, samples, tokenizer, args, context_length, device, reward_model, judge,
            verifier):
    """The rows of ``measure`` for the prompts ``start .. start + MEASURE_PROMPTS`` (``ref`` None: the same weights
    as the policy)."""
    batch = prompts[start:start + MEASURE_PROMPTS]
    sequences, full, _, P = sample_responses(policy, batch, tokenizer, args, context_length, device, samples)
    rows = _rows(sequences, P, each(range(start, start + len(batch)), samples), None, tokenizer)
    for j, row in enumerate(rows):
        row["sample"] = j % samples
    if isinstance(batch[0], dict):  # a problem's greedy answer too (it draws no random numbers), from its prompt
        query, mask = sequences[::samples, :P], full[::samples, :P]  # (b, P) each
        rows += _rows(generate(policy, query, args.max_new_tokens, context_length, eos_id=EOS_ID,
                               attention_mask=mask), P, range(start, start + len(batch)), -1, tokenizer)
    sampled = rows[:len(sequences)]
    read = [r for r, row in enumerate(sampled) if row["sample"] < READ_SAMPLES]  # the answers read in depth
    response_mask = full[read, P:].float()
    k = min(samples, READ_SAMPLES)  # the answers read to each prompt: consecutive rows, each prompt read once
    logprobs, entropy = response_logprobs(policy, sequences[read], full[read], response_mask, P, entropy=True,
                                          samples=k)
    kl = (torch.zeros(len(read)) if ref is None else  # the same weights: exactly 0, no second pass
          kl_per_response(logprobs, response_logprobs(ref, sequences[read], full[read], response_mask, P, samples=k),
                          response_mask))
    for i, r in enumerate(read):
        sampled[r].update(kl=kl[i].item(), entropy=entropy[i].sum().item(), tokens=response_mask[i].sum().item())
    if reward_model is not None:  # the RM and the judge on the answers read to the prompts they score
        chosen = [r for r in read if scored(prompts[sampled[r]["prompt"]])]
        if chosen:
            rm = reward_model(sequences[chosen], full[chosen])["rewards"].float().tolist()
            judged = judge([sampled[r]["text"] or "" for r in chosen])
            for r, s, j in zip(chosen, rm, judged):
                sampled[r].update(rm_score=s, judge=j)
    if isinstance(batch[0], dict):
        lax = contains if verifier in (None, "exact") else VERIFIERS[verifier]
        for row in rows:
            t, x = prompts[row["prompt"]], row["text"]
            row["right"] = solved(t, x, row["ended"])
            row["lax"] = x is not None and lax(t["family"], x, t["answer"], t["prompt"])
    return rows


def _rows(sequences, prompt_len: int, prompt_of, sample, tokenizer) -> list[dict]:
    """One row per generated sequence (B, P + R): its prompt's index (``prompt_of``), and the response's ids up to
    its first [SEP], their text and whether it ended (``tasks.generated_answers``)."""
    texts, ended, ids = generated_answers(sequences, prompt_len, tokenizer)
    return [{"prompt": p, "sample": sample, "ids": i, "text": t, "ended": e}
            for p, t, e, i in zip(prompt_of, texts, ended, ids)]


def answer_monitors(rows: list[dict]) -> dict:
    """The preference path's summary of ``measure``'s rows: ``judge.summarize`` over the sampled answers (the RM
    score, the judge, KL and entropy over the answers read in depth, the first ``READ_SAMPLES`` of each prompt)."""
    sampled = [r for r in rows if r["sample"] >= 0]
    rated = [r for r in sampled if "rm_score" in r]
    first = [r for r in sampled if "kl" in r]
    entropy = sum(r["entropy"] for r in first) / max(sum(r["tokens"] for r in first), 1.0)
    return summarize([r["ids"] for r in sampled], [r["ended"] for r in sampled], [r["rm_score"] for r in rated],
                     [r["judge"] for r in rated], [r["kl"] for r in first], entropy)


def describe(m: dict) -> str:
    """One line of held-out monitors for the console."""
    return (f"RM score {m['rm_score']:.3f}, judge {m['judge']:.3f} ± {m['judge_se']:.3f}, KL {m['kl']:.2f}, "
            f"entropy {m['entropy']:.2f}, length {m['length']:.1f}, ends with [SEP] {m['eos_share']:.0%}, "
            f"distinct-2 {m['distinct_2']:.3f}, longest run {m['longest_run']:.1f}")


@dataclass(frozen=True)
class Path:
    """What one kind of reward makes of the held-out rows: its ``summary(rows, prompts, samples)`` -> monitors,
    the one-line ``describe`` of them, its ``flag(before, after, kl_limit)`` -> "" or a sentence, and the headline
    ``closing(sft, after, name)`` of the stage's last message."""
    summary: Callable
    describe: Callable
    flag: Callable
    closing: Callable


PREFERENCES = Path(
    summary=lambda rows, prompts, samples: answer_monitors(rows), describe=describe, flag=reward_hacking_flag,
    closing=lambda sft, after, name: (f"held-out RM score {sft['rm_score']:.3f} (SFT) -> {after['rm_score']:.3f} "
                                      f"({name}), judge {sft['judge']:.3f} -> {after['judge']:.3f}, KL "
                                      f"{after['kl']:.2f} nats/response"))
TASKS = Path(
    summary=task_monitors, describe=describe_tasks, flag=task_hacking_flag,
    closing=lambda sft, after, name: (f"held-out sampled pass@1 {sft['all_pass1']:.1%} (SFT) -> "
                                      f"{after['all_pass1']:.1%} ({name}), greedy {sft['all_greedy']:.1%} -> "
                                      f"{after['all_greedy']:.1%}, KL {after['kl']:.2f} nats/response"))


def as_val_row(monitors: dict) -> dict:
    """Held-out monitors as metrics-row keys: rm_score -> val_score (the curve's old name), x -> val_x."""
    return {("val_score" + k[len("rm_score"):] if k.startswith("rm_score") else "val_" + k): v
            for k, v in monitors.items()}


def from_val_row(row: dict) -> dict:
    """The inverse of ``as_val_row`` (the SFT monitors are read back from step 0's row on --resume); a stage's own
    ``val_`` figures that are no monitors (DPO's val_loss, val_accuracy, val_margin) are left out."""
    monitors = {}
    for k, v in row.items():
        if k.startswith("val_score"):
            monitors["rm_score" + k[len("val_score"):]] = v
        elif k.startswith("val_") and k not in ("val_loss", "val_accuracy", "val_margin"):
            monitors[k[len("val_"):]] = v
    return monitors


def rounded(monitors: dict) -> dict:
    # 6 places: the report prints 3, and rounding twice (to 4, then 3) could show 0.996 where the log said 0.995
    return {k: round(v, 6) for k, v in monitors.items()}


def write_samples(path, prompts, rows, limit: int = 12) -> None:
    """``samples.md``: the first ``limit`` prompts, their answer where a problem has one, and the policy's answer
    to each (the greedy one for a problem, else the first sample), with its RM score where it has one."""
    problems = isinstance(prompts[0], dict)
    shown = {r["prompt"]: r for r in rows if r["sample"] == (-1 if problems else 0) and r["prompt"] < limit}
    header = ("problem", "answer", "response") if problems else ("prompt", "response", "RM score")
    table = [((prompts[i]["prompt"], prompts[i]["answer"]) if problems else (shown_prompt(prompts[i]),))
             + ("(a special token)" if r["text"] is None else r["text"],)
             + (() if problems else (round(r.get("rm_score", float("nan")), 3),))
             for i, r in sorted(shown.items())]
    with open(path, "w", encoding="utf-8") as f:
        f.write(markdown_table(header, table))


class HeldOut:
    """The held-out measurement of an alignment stage: the SFT policy before any update (``before``), the policy
    now and then (``val_row``), the aligned policy at the end (``after``), each ``measure``d in eval mode (dropout
    off) under the stage's autocast (the precision of its updates, so scores and KL compare like with like),
    summed up by the ``path`` and printed on one line.

    Args:
        stage: the stage's ``training.StageRun``; policy: the unwrapped policy (a ``GPTModel``); ref: the frozen SFT
            reference; prompts: the held-out prompts (strings, conversations or problems); args: the stage's
            arguments (``eval_samples``, ``max_new_tokens``, ``seed``); path: ``PREFERENCES`` or ``TASKS``;
            reward_model, judge: they read the answers of the ``scored`` prompts (or None); verifier: the checker
            the stage trains with; sft_samples: answers per prompt of the SFT policy (default ``eval_samples``);
            settings: what the stage's results record besides the sampling settings (e.g. ``rm_weight``).
    """

    def __init__(self, stage, policy, ref, prompts, tokenizer, args, context_length: int, path: Path, *,
                 reward_model=None, judge=None, verifier=None, sft_samples: int | None = None, settings=None):
        self.stage, self.policy, self.ref, self.prompts, self.path = stage, policy, ref, prompts, path
        self.tokenizer, self.args, self.context_length = tokenizer, args, context_length
        self.reward_model, self.judge, self.verifier = reward_model, judge, verifier
        self.sft_samples = sft_samples or args.eval_samples
        self.settings = {"prompts": [prompt_text(p) for p in prompts], "samples_per_prompt": args.eval_samples,
                         "sft_samples_per_prompt": self.sft_samples, "temperature": 1.0,
                         "max_new_tokens": args.max_new_tokens, "rm_samples": READ_SAMPLES, "verifier": verifier,
                         **(settings or {})}

    def measure(self, tag: str, samples: int | None = None):
        """(monitors, rows) of the policy as it is now, ``samples`` (default ``--eval_samples``) per prompt."""
        samples = samples or self.args.eval_samples
        was_training = self.policy.training
        self.policy.eval()
        with self.stage.accelerator.autocast():
            rows = measure(self.policy, self.ref, self.prompts, samples, self.tokenizer, self.args,
                           self.context_length, self.stage.accelerator.device, reward_model=self.reward_model,
                           judge=self.judge, verifier=self.verifier)
        self.policy.train(was_training)
        monitors = self.path.summary(rows, self.prompts, samples)
        self.stage.print(f"{tag} on {len(self.prompts)} held-out prompts x {samples}: {self.path.describe(monitors)}")
        return monitors, rows

    def val_row(self, tag: str) -> dict:
        """The monitors of the policy now as keys of a metrics row."""
        return as_val_row(self.measure(tag)[0])

    def before(self, first_row=None) -> dict:
        """The SFT policy's monitors: measured and logged at step 0 (with ``first_row()``'s values, if given), read
        back from the step-0 row after ``--resume``."""
        if self.stage.step == 0:
            row = first_row() if first_row is not None else {}
            self.stage.log({**row, **as_val_row(self.measure("SFT policy", self.sft_samples)[0])})
        return from_val_row(self.stage.metrics.rows[0])

    def after(self, name: str, sft: dict, kl_limit: float = KL_LIMIT) -> dict:
        """The aligned policy's monitors, recorded with the SFT ones (``sft``), the flag (printed when raised) and
        the settings in the stage's results, and samples.md; ``name`` is the stage ("ppo", ...). Returns the
        monitors."""
        monitors, rows = self.measure(f"{name.upper()} policy")
        self.stage.metrics.rows[-1].update(as_val_row(monitors))
        flag = self.path.flag(sft, monitors, kl_limit)
        self.stage.results.update({"held_out": {"sft": rounded(sft), name: rounded(monitors)},
                                   "held_out_settings": self.settings, "kl": monitors["kl"], "kl_limit": kl_limit,
                                   "reward_hacking": flag})
        self.stage.files["samples.md"] = lambda path: write_samples(path, self.prompts, rows)
        if flag:
            self.stage.print(flag)
        return monitors

    def summary(self, sft: dict, after: dict, name: str) -> str:
        """The closing message's figures: SFT -> the aligned policy."""
        return self.path.closing(sft, after, name)
