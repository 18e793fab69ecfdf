"""What the alignment stages (3-PPO.py, 3-DPO.py, 3-GRPO.py) share, written once: where their reward comes from and
how their answers are measured. (Sampling and log-probabilities are in ``rollouts.py``; the verifiable tasks'
reward and measurement in ``tasks.py``.)

"Reward" names four things in these stages; every figure says which:

* the **RM score**: the reward model's number for an answer (``rm_reward``), what PPO and GRPO maximise on the
  preference path and what the held-out "RM score" is;
* the **verifier**: 1 when a program accepts the answer, else 0 (``tasks.verifier_reward``), the reward with
  ``--verifier``; its held-out mean is the exact accuracy (pass@1);
* the **judge**: the independent sentiment classifier (``judge.SentimentJudge``), never trained on, only measured
  beside the other two, so that a policy that fools its reward shows;
* **DPO's implicit reward**: beta * log(pi / pi_ref) of an answer, what 3-DPO.py ranks pairs by; it is never
  computed for a sampled answer.

The first two are one interface, ``reward(prompts, responses)`` -> one float per response (as TRL's reward
functions), which ``rollouts.rollout`` calls the same way for PPO and GRPO.

* rewards: ``rm_reward`` (the verifier's twin is ``tasks.verifier_reward``) and ``check_rewards`` (a non-finite
  reward stops the run before any update);
* monitors: ``monitors_of`` and ``held_out_monitors`` (the RM score beside the independent judge, KL, entropy,
  length, ``[SEP]`` share and repetition, see ``judge.py``), their metrics-row names (``as_val_row``,
  ``from_val_row``), ``describe`` for the console and ``write_samples`` for samples.md;
* the held-out measurement before and after a stage, one story for both paths (``HeldOutBase``): ``HeldOut``
  (the RM score and the judge; PPO, DPO, GRPO) and ``TaskHeldOut`` (exact accuracy, with ``--verifier``);
* set-up: ``add_held_out_arguments`` (the reward's and the held-out monitors' flags, the same in all three stages),
  ``read_prompts``, ``load_policy_and_ref``, ``load_reward_model``, ``load_policy_and_reward`` and ``Online``
  (an online aligner's policy, reference, prompts and reward, from an RM or a verifier), ``online_defaults``.

The stage-specific maths (PPO's GAE and clipped losses, DPO's loss, GRPO's group advantages) stays in each stage.
"""

from __future__ import annotations

import copy
import os
import sys

import torch
from accelerate import PartialState

from chinese_tokenizer import decode
from lora import AdaptersOff, add_lora, trainable_parameters
from plumbing.checkpoint import CHAT_STAGES, load_backbone, load_checkpoint, parent_meta, read_config, weights_digest
from plumbing.cli import UserError, default_path, fill_defaults, positive_int
from plumbing.devices import forked_rng
from plumbing.judge import KL_LIMIT, SentimentJudge, reward_hacking_flag, summarize
from plumbing.markdown import markdown_table
from plumbing.records import read_prompt_files, read_tasks, shown_prompt
from plumbing.rollouts import kl_per_response, response_token_lists, rollout
from plumbing.tasks import (
    RM_SAMPLES,
    SFT_SAMPLES,
    asks_for_praise,
    describe_tasks,
    measure_tasks,
    review_polarity,
    task_hacking_flag,
    task_rollout_row,
    verifier_reward,
    write_task_samples,
)
from plumbing.verifiers import VERIFIERS


def check_rewards(scores, prompts, iteration: int) -> None:
    """Stop before any update when a reward is not finite: one NaN RM score would turn its group's advantages (GRPO)
    or its response's returns (PPO) into NaN, which backward and an optimizer step would spread to every weight.

    Args:
        scores: (B,) rewards of the responses to ``prompts`` (one prompt per row).
    Raises:
        UserError: naming the first prompt whose answer got a non-finite reward and the iteration.
    """
    bad = (~torch.isfinite(scores)).nonzero()
    if len(bad):
        i = int(bad[0])
        raise UserError(f"iteration {iteration}: the reward of the answer to prompt {shown_prompt(prompts[i])!r} is "
                        f"{scores[i].item()} ({len(bad)} of {len(scores)} rewards are not finite); the reward model "
                        f"(--reward) is broken: score a few texts with 2-RM.py --score to see, and retrain it")


def rm_reward(reward_model):
    """The reward model as a reward: ``reward(prompts, responses)`` -> (B,) float32, the one interface every reward
    of the online aligners has (as TRL's reward functions; the verifier's is ``tasks.verifier_reward``). Each
    response is scored as generated, the whole sequence read at its last real token (an unfinished answer has no
    [SEP]). ``responses``: a rollout's dict (``rollouts.rollout``); ``prompts`` are not read, the RM reads tokens."""
    def reward(prompts, responses):
        return reward_model(responses["input_ids"], responses["attention_mask"])["rewards"].float()
    return reward


def monitors_of(batches, judge, tokenizer):
    """``judge.summarize`` over the responses of one or more ``rollout`` dicts (the RM score is the raw score,
    before the no-[SEP] penalty; entropy is the mean over all real response tokens). Returns (monitors, texts)."""
    ids = [r for data in batches for r in response_token_lists(data)]
    texts = [decode(r, tokenizer) for r in ids]
    cat = {k: torch.cat([data[k] for data in batches]) for k in ("ended", "scores")}
    kl = torch.cat([kl_per_response(d["logprobs"], d["ref_logprobs"], d["response_mask"]) for d in batches])
    entropy = sum((d["entropy"] * d["response_mask"]).sum() for d in batches) / sum(
        d["response_mask"].sum() for d in batches).clamp(min=1)
    return summarize(ids, cat["ended"].tolist(), cat["scores"].tolist(), judge(texts), kl.tolist(),
                     entropy.item()), texts


HELD_OUT_BATCH = 64  # responses per batch of the held-out monitors, the same in every stage (64 decoded fastest)
# Held-out monitors already measured in this process, by everything that decides them (``held_out_key``). The
# pipeline runs PPO, DPO and GRPO in one process, and each starts by measuring the same SFT policy on the same
# draws: the second and third get the first one's figures instead of sampling them again.
_MEASURED: dict = {}


def held_out_key(policy, ref, reward_model, judge, prompts, args, context_length, device, seed) -> tuple:
    """What ``held_out_monitors`` depends on: the three models' weights, the judge, the prompts, the sampling
    settings, the seed, the device and the autocast precision in force."""
    kind = torch.device(device).type
    autocast = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None
    return (weights_digest(policy, ref, reward_model), type(judge).__name__, repr(list(prompts)),
            args.eval_samples, args.max_new_tokens, context_length, str(device), seed, str(autocast),
            HELD_OUT_BATCH)


@torch.no_grad()
def held_out_monitors(policy, ref, reward_model, judge, prompts, tokenizer, args, context_length, device, seed):
    """The monitors of ``args.eval_samples`` sampled responses per held-out prompt, with a fixed seed and batches of
    ``HELD_OUT_BATCH`` (so the SFT policy and every aligned one, PPO, DPO or GRPO, are compared on the same draws of
    randomness), and every (prompt, response, RM score) for samples.md. A measurement this process has made
    already (same weights, prompts and settings: ``held_out_key``) is returned again instead of being redone."""
    key = held_out_key(policy, ref, reward_model, judge, prompts, args, context_length, device, seed)
    if key not in _MEASURED:
        _MEASURED[key] = _measure_held_out(policy, ref, reward_model, judge, prompts, tokenizer, args,
                                           context_length, device, seed)
    return copy.deepcopy(_MEASURED[key])


def _measure_held_out(policy, ref, reward_model, judge, prompts, tokenizer, args, context_length, device, seed):
    flat = [p for p in prompts for _ in range(args.eval_samples)]
    with forked_rng(device):
        torch.manual_seed(seed)
        reward = rm_reward(reward_model)
        batches = [rollout(policy, flat[start:start + HELD_OUT_BATCH], ref=ref, reward=reward, tokenizer=tokenizer,
                           args=args, context_length=context_length, device=device)
                   for start in range(0, len(flat), HELD_OUT_BATCH)]
    monitors, texts = monitors_of(batches, judge, tokenizer)
    scores = torch.cat([data["scores"] for data in batches]).tolist()
    examples = [{"prompt": p, "response": t, "score": round(s, 3)} for p, t, s in zip(flat, texts, scores)]
    return monitors, examples


ROLLOUT_MONITORS = ("judge", "kl", "entropy", "length", "eos_share", "distinct_2", "longest_run")


def as_val_row(monitors: dict) -> dict:
    """Held-out monitors as metrics-row keys: rm_score -> val_score (the curve's old name), x -> val_x."""
    return {("val_score" + k[len("rm_score"):] if k.startswith("rm_score") else "val_" + k): v
            for k, v in monitors.items()}


def from_val_row(row: dict) -> dict:
    """The inverse of ``as_val_row`` (the SFT monitors are read back from step 0's row on --resume)."""
    monitors = {}
    for k, v in row.items():
        if k.startswith("val_score") and k != "val_score_sft":
            monitors["rm_score" + k[len("val_score"):]] = v
        elif k.startswith("val_") and k != "val_score_sft":
            monitors[k[len("val_"):]] = v
    return monitors


def rounded(monitors: dict) -> dict:
    # 6 places: the report prints 3, and rounding twice (to 4, then 3) could show 0.996 where the log said 0.995
    return {k: round(v, 6) for k, v in monitors.items()}


def describe(m: dict) -> str:
    """One line of held-out monitors for the console."""
    return (f"RM score {m['rm_score']:.3f}, judge {m['judge']:.3f} ± {m['judge_se']:.3f}, KL {m['kl']:.2f}, "
            f"entropy {m['entropy']:.2f}, length {m['length']:.1f}, ends with [SEP] {m['eos_share']:.0%}, "
            f"distinct-2 {m['distinct_2']:.3f}, longest run {m['longest_run']:.1f}")


def write_samples(path, examples):
    """``samples.md``: an aligned policy's held-out answers (the first sample of each prompt) with their RM scores."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(markdown_table(("prompt", "response", "RM score"),
                               [(shown_prompt(e["prompt"]), e["response"], e["score"]) for e in examples]))


# the keys of ``judge.summarize`` with KL and entropy: what the held-out monitors hold (a step-0 row also has DPO's
# val_loss / val_accuracy / val_margin, which are no monitors)
MONITOR_KEYS = ("rm_score", "rm_score_se", "judge", "judge_se", "distinct_2", "longest_run", "eos_share", "length",
                "kl", "kl_se", "entropy")


class HeldOutBase:
    """The held-out measurement of an alignment stage, one story for both paths: the SFT policy before any update,
    the policy now and then, the aligned policy at the end, each measured in eval mode (dropout off) under the
    stage's autocast (the precision of its updates, so scores and KL compare like with like) and printed on one line.

    * ``measure(tag, samples)``: (monitors, examples) of the policy now, ``samples`` answers per held-out prompt;
    * ``val_row(tag)``: the monitors now as keys of a metrics row;
    * ``before(first_row)``: step 0, the SFT policy with ``sft_samples`` answers per prompt, logged in the step-0
      metrics row (beside the stage's own ``first_row()``, e.g. DPO's pair metrics); on ``--resume`` read back from
      that row;
    * ``after(name, sft)``: the aligned policy's monitors, recorded in the last metrics row and in the stage's
      results with the SFT ones, the reward-hacking flag and the settings they were sampled with; samples.md.

    A path says what it measures: ``sample(samples)`` -> (monitors, examples), ``describe``, ``as_row`` and
    ``from_row`` (the metrics-row keys), ``flag`` (``judge.reward_hacking_flag`` or ``tasks.task_hacking_flag``),
    ``results`` (what the stage's config.json keeps), ``write_samples``, ``summary`` and ``rollout_row`` (what a
    training rollout's row says). ``HeldOut`` is the preference path, ``TaskHeldOut`` the verifiable one.

    Args:
        stage: the stage's ``training.StageRun``; policy: the unwrapped policy (a ``GPTModel``); ref: the frozen SFT
            reference; prompts: the held-out prompts (or problems); args: the stage's arguments (``eval_samples``,
            ``max_new_tokens``, ``seed``).
    """
    unit = "prompts"

    def __init__(self, stage, policy, ref, prompts, tokenizer, args, context_length: int):
        self.stage, self.policy, self.ref, self.prompts = stage, policy, ref, prompts
        self.tokenizer, self.args, self.context_length = tokenizer, args, context_length
        self.sft_samples = args.eval_samples

    def measure(self, tag: str, samples: int | None = None):
        """(monitors, examples) of the policy as it is now, ``samples`` (default ``--eval_samples``) per prompt."""
        samples = samples or self.args.eval_samples
        was_training = self.policy.training
        self.policy.eval()
        with self.stage.accelerator.autocast():
            monitors, examples = self.sample(samples)
        self.policy.train(was_training)
        self.stage.print(f"{tag} on {len(self.prompts)} held-out {self.unit} x {samples}: {self.describe(monitors)}")
        return monitors, examples

    def val_row(self, tag: str) -> dict:
        """The monitors of the policy now as keys of a metrics row."""
        return self.as_row(self.measure(tag)[0])

    def before(self, first_row=None) -> dict:
        """The SFT policy's monitors: measured and logged at step 0 (with ``first_row()``'s values, if given), read
        back from the step-0 row after ``--resume``."""
        if self.stage.step == 0:
            row = first_row() if first_row is not None else {}
            self.stage.log({**row, **self.as_row(self.measure("SFT policy", self.sft_samples)[0])})
        return self.from_row(self.stage.metrics.rows[0])

    def after(self, name: str, sft: dict, kl_limit: float = KL_LIMIT) -> dict:
        """The aligned policy's monitors, recorded with the SFT ones (``sft``), the flag (printed when raised) and
        ``settings``; ``name`` is the stage ("ppo", ...). Returns the monitors."""
        monitors, examples = self.measure(f"{name.upper()} policy")
        self.stage.metrics.rows[-1].update(self.as_row(monitors))
        flag = self.flag(sft, monitors, kl_limit)
        self.stage.results.update({**self.results(name, sft, monitors), "kl": monitors["kl"], "kl_limit": kl_limit,
                                   "reward_hacking": flag})
        self.stage.files["samples.md"] = lambda path: self.write_samples(path, examples)
        if flag:
            self.stage.print(flag)
        return monitors


class HeldOut(HeldOutBase):
    """The preference path's held-out measurement (PPO, DPO and GRPO with a reward model): the RM score beside the
    independent judge, KL, entropy, length, [SEP] share and repetition of ``--eval_samples`` sampled answers per
    held-out prompt (``held_out_monitors``), the reward-hacking flag of ``judge.reward_hacking_flag``.

    Args: as ``HeldOutBase``, and reward_model: the frozen RM.
    """

    def __init__(self, stage, policy, ref, reward_model, prompts, tokenizer, args, context_length: int):
        super().__init__(stage, policy, ref, prompts, tokenizer, args, context_length)
        self.reward_model, self.judge = reward_model, SentimentJudge()

    @property
    def settings(self) -> dict:
        return {"prompts": list(self.prompts), "samples_per_prompt": self.args.eval_samples, "temperature": 1.0,
                "max_new_tokens": self.args.max_new_tokens}

    def sample(self, samples: int):
        args = copy.copy(self.args)
        args.eval_samples = samples
        return held_out_monitors(self.policy, self.ref, self.reward_model, self.judge, self.prompts, self.tokenizer,
                                 args, self.context_length, self.stage.accelerator.device, self.args.seed)

    describe = staticmethod(describe)
    as_row = staticmethod(as_val_row)

    @staticmethod
    def from_row(row: dict) -> dict:
        return {k: v for k, v in from_val_row(row).items() if k in MONITOR_KEYS}

    flag = staticmethod(reward_hacking_flag)

    def results(self, name: str, sft: dict, after: dict) -> dict:
        return {"val_score_sft": sft["rm_score"], f"val_score_{name}": after["rm_score"],
                "val_score_gain": after["rm_score"] - sft["rm_score"],
                "held_out": {"sft": rounded(sft), name: rounded(after)}, "held_out_settings": self.settings}

    def write_samples(self, path, examples):
        write_samples(path, examples[::self.args.eval_samples][:12])  # the first sample of each prompt

    def rollout_row(self, data) -> dict:
        """What a training rollout's metrics row says on this path: the RM score (before the no-[SEP] penalty), the
        judge, KL, entropy, length, [SEP] share and repetition (``monitors_of``)."""
        monitors = monitors_of([data], self.judge, self.tokenizer)[0]
        return {"score": monitors["rm_score"], **{k: monitors[k] for k in ROLLOUT_MONITORS}}

    @staticmethod
    def summary(sft: dict, after: dict, name: str) -> str:
        """The closing message's figures: SFT -> the aligned policy."""
        return (f"held-out RM score {sft['rm_score']:.3f} (SFT) -> {after['rm_score']:.3f} ({name}), judge "
                f"{sft['judge']:.3f} -> {after['judge']:.3f}, KL {after['kl']:.2f} nats/response")


class TaskHeldOut(HeldOutBase):
    """The verifiable path's held-out measurement (GRPO and PPO with ``--verifier``): exact accuracy on held-out
    problems (``tasks.measure_tasks``), the SFT policy at step 0 with ``tasks.SFT_SAMPLES`` samples per problem (its
    pass@4 and pass@16 are best-of-4 and best-of-16 by the verifier), the aligned one with ``--eval_samples``; the
    flag of ``tasks.task_hacking_flag``.

    Args: as ``HeldOutBase`` (``prompts``: the held-out problems), and verifier: the name the stage trains with
        (``--verifier``); reward_model: a frozen RM that scores the answers to the problems asking for a 好评, beside
        the independent judge (here a monitor), or None; review_weight: the weight it had in the training reward
        (``Online.review_weight``, GRPO's ``--rm_weight``), which ``settings`` records.
    """
    unit = "problems"

    def __init__(self, stage, policy, ref, tasks, tokenizer, args, context_length: int, verifier: str,
                 reward_model=None, review_weight: float = 0.0):
        super().__init__(stage, policy, ref, tasks, tokenizer, args, context_length)
        self.sft_samples, self.verifier, self.reward_model = SFT_SAMPLES, verifier, reward_model
        self.review_weight = review_weight
        self.judge = SentimentJudge() if reward_model is not None else None

    @property
    def settings(self) -> dict:
        return {"problems": len(self.prompts), "families": sorted({t["family"] for t in self.prompts}),
                "sft_samples": SFT_SAMPLES, "samples": self.args.eval_samples, "temperature": 1.0,
                "max_new_tokens": self.args.max_new_tokens, "verifier": self.verifier, "rm_samples": RM_SAMPLES,
                # the weight of the RM's term in the training reward (GRPO's --rm_weight), 0 if it had none
                "rm_weight": self.review_weight}

    def sample(self, samples: int):
        return measure_tasks(self.policy, self.ref, self.prompts, self.tokenizer, samples, self.args.max_new_tokens,
                             self.context_length, self.stage.accelerator.device, self.args.seed, self.verifier,
                             self.reward_model, self.judge)

    describe = staticmethod(describe_tasks)

    @staticmethod
    def as_row(monitors: dict) -> dict:
        return {f"task_{k}": v for k, v in monitors.items()}

    @staticmethod
    def from_row(row: dict) -> dict:
        return {k[len("task_"):]: v for k, v in row.items() if k.startswith("task_")}

    flag = staticmethod(task_hacking_flag)

    def results(self, name: str, sft: dict, after: dict) -> dict:
        return {"tasks": {"sft": rounded(sft), name: rounded(after)}, "task_settings": self.settings}

    @staticmethod
    def write_samples(path, examples):
        write_task_samples(path, examples[:12])

    rollout_row = staticmethod(task_rollout_row)

    @staticmethod
    def summary(sft: dict, after: dict, name: str) -> str:
        """The closing message's figures: SFT -> the aligned policy."""
        return (f"held-out sampled pass@1 {sft['all_pass1']:.1%} (SFT) -> {after['all_pass1']:.1%} ({name}), greedy "
                f"{sft['all_greedy']:.1%} -> {after['all_greedy']:.1%}, KL {after['kl']:.2f} nats/response")


def add_held_out_arguments(p, stage: str) -> None:
    """The flags of the reward and of the held-out monitors, one definition for PPO, DPO and GRPO so that all three
    are measured alike: the RM that scores (``--reward``; PPO and GRPO may take a ``--verifier`` instead), the
    held-out prompts and how their answers are sampled. There is no ``--temperature``: every stage samples from the
    policy itself (temperature 1), because the log-probs it trains on and the KL it reports are those of the
    policy; sampling at another temperature would score one distribution and train another."""
    p.add_argument("--reward", default=default_path("checkpoints", "rm"),
                   help="reward model checkpoint (2-RM.py)" + (
                       "; with --verifier it scores the held-out answers to 好评 instructions, beside the judge (and "
                       "in GRPO, with --rm_weight, the training answers to 好评 and 差评 instructions too, as part of "
                       "the reward)"
                       if stage != "DPO" else ": it scores the held-out answers only, DPO never trains on it"))
    if stage != "DPO":
        p.add_argument("--verifier", choices=sorted(VERIFIERS),
                       help="train on the verifiable tasks instead, rewarded 1 when this checker accepts the answer "
                            "(exact: the whole answer, strictly; contains: a deliberately lax one), and measure "
                            "exact accuracy on held-out problems; the defaults become the review instructions' files "
                            "(data/instructions/) and the preset's values 'with --verifier'")
    p.add_argument("--val_prompts_file",
                   help="held-out prompts: the monitors (RM score, judge, KL, ...) before and after "
                        f"{stage} (default: data/ppo/val_prompts.jsonl; with --verifier data/instructions/test.jsonl, "
                        f"whose problems no stage trains on)")
    p.add_argument("--eval_samples", type=positive_int, help="sampled responses per held-out prompt for the monitors")
    p.add_argument("--max_new_tokens", type=positive_int, help="longest response")


# where the online aligners read their prompts, by the kind of reward (``--verifier`` or not)
PROMPT_FILES = {False: {"prompts_file": default_path("data", "ppo", "prompts.jsonl"),
                        "val_prompts_file": default_path("data", "ppo", "val_prompts.jsonl")},
                True: {"prompts_file": default_path("data", "instructions", "train.jsonl"),
                       "val_prompts_file": default_path("data", "instructions", "test.jsonl")}}


def read_val_prompts(args) -> list:
    """The first ``--eval_examples`` held-out prompts of ``--val_prompts_file`` (strings, or conversations as
    tuples of turns: ``records.prompt_of``); ``UserError`` names a bad line."""
    return read_prompt_files(args.val_prompts_file, "--val_prompts_file")[:args.eval_examples]


def read_prompts(args) -> tuple[list, list]:
    """The prompts the policy practises on (``--prompts_file``) and the first ``--eval_examples`` held-out ones
    (``--val_prompts_file``) that measure it: strings and conversations, or with ``--verifier`` verifiable problems
    (``records.read_tasks``). Raises ``UserError`` naming a bad file and line."""
    if getattr(args, "verifier", None):
        return (read_tasks(args.prompts_file, "--prompts_file"),
                read_tasks(args.val_prompts_file, "--val_prompts_file")[:args.eval_examples])
    return read_prompt_files(args.prompts_file, "--prompts_file"), read_val_prompts(args)


def load_policy_and_ref(args, tokenizer, device):
    """The SFT policy (``--policy``, train mode, on the CPU for ``accelerator.prepare``), a frozen copy of it as the
    reference (eval mode, on ``device``) and what the child checkpoint records about its parent.

    With ``--lora_rank`` the policy gets LoRA adapters (``lora.add_lora``: only they train) and the reference is
    no copy but the same network with its adapters off (``lora.AdaptersOff``): its frozen base is the SFT model.

    Raises:
        UserError: a missing or wrong checkpoint, or another vocabulary.
    """
    policy, parent = load_backbone(args.policy, "--policy", tokenizer, "1-SFT.py")
    if getattr(args, "lora_rank", None):
        add_lora(policy, args.lora_rank, args.lora_alpha, args.lora_targets, dropout=policy.cfg.drop_rate)
        print(f"LoRA rank {args.lora_rank} on {', '.join(args.lora_targets)}: {trainable_parameters(policy):,} of "
              f"{sum(p.numel() for p in policy.parameters()):,} parameters train", flush=True)
        return policy, parent, AdaptersOff(policy)
    ref = copy.deepcopy(policy)  # the SFT model as it is now, before --resume loads the trained policy
    ref.requires_grad_(False).eval().to(device)
    return policy, parent, ref


def note_if_not_chat(args) -> None:
    """A note on stderr when ``--policy`` was not fine-tuned on the chat template: allowed (an experiment may want
    it), but the usual slip is to pass checkpoints/pretrain for checkpoints/sft. Printed once everything loaded."""
    stage = read_config(args.policy).get("stage")
    if stage not in CHAT_STAGES and PartialState().is_main_process:
        print(f"note: --policy {args.policy} is a {stage} checkpoint that has not been fine-tuned on the chat "
              f"template (1-SFT.py), so its answers start from plain continuation", file=sys.stderr)


def check_room(args, context_length: int, of: str) -> None:
    """``UserError`` when ``--max_new_tokens`` leaves no room for a prompt in ``context_length`` positions."""
    if args.max_new_tokens > context_length - 3:
        raise UserError(f"--max_new_tokens {args.max_new_tokens} leaves no room for a prompt in a context of "
                        f"{context_length} ({of}); lower it")


def load_reward_model(args, vocab_size: int, device):
    """The frozen reward model of ``--reward``, in eval mode on ``device``.

    Raises:
        UserError: no reward checkpoint there, or another vocabulary than the policy's ``vocab_size``.
    """
    if not os.path.isfile(os.path.join(args.reward, "config.json")):
        raise UserError(f"--reward {args.reward}: no checkpoint there; train the reward model with 2-RM.py first "
                        f"or point --reward at one")
    reward_model, _, _ = load_checkpoint(args.reward, "reward", flag="--reward")
    if reward_model.cfg.vocab_size != vocab_size:
        raise UserError(f"--reward {args.reward} has vocab_size {reward_model.cfg.vocab_size} but --policy "
                        f"{args.policy} has {vocab_size}; train both from the same tokenizer")
    return reward_model.requires_grad_(False).eval().to(device)


def load_policy_and_reward(args, tokenizer, device):
    """The models of a stage measured by the RM (DPO): ``load_policy_and_ref`` and ``load_reward_model``, and the
    context both can read.

    Returns:
        (policy, parent metadata, ref, reward_model, context_length).
    Raises:
        UserError: as those two, or ``--max_new_tokens`` that leaves no room for a prompt.
    """
    policy, parent, ref = load_policy_and_ref(args, tokenizer, device)
    reward_model = load_reward_model(args, policy.cfg.vocab_size, device)
    context_length = min(policy.cfg.context_length, reward_model.cfg.context_length)
    check_room(args, context_length, "the shorter of policy and reward model")
    note_if_not_chat(args)
    return policy, parent, ref, reward_model, context_length


class Online:
    """What an online aligner (3-PPO.py, 3-GRPO.py) learns from, whichever the reward: the SFT policy and its frozen
    reference, the prompts it practises on and the held-out ones that measure it, and the reward of a rollout.

    * With ``--reward`` (preferences): ``reward_model`` scores each answer (``rm_reward``); the held-out monitors
      put its score beside the independent judge (``HeldOut``).
    * With ``--verifier`` (verifiable tasks): a checker gives 1 or 0 (``tasks.verifier_reward``), there is no
      reward model (``reward_model`` is None), and the held-out measure is exact accuracy (``TaskHeldOut``);
      where problems ask for a review and ``--reward`` holds a checkpoint, that RM (``review_model``) scores the
      answers: those to the held-out 好评 problems beside the judge, and with GRPO's ``--rm_weight`` those to the
      training 好评 and 差评 problems too, a second term of the reward (``review_scores``, negated on a 差评) so
      that a constraint is not kept by writing worse reviews.

    Attributes: policy, ref, parent (the parent metadata the checkpoint records, with the reward's), prompts,
    held_out_prompts, reward_model, review_model, review_weight (the weight the RM has in the reward: 0 where it has
    none, whatever ``--rm_weight`` says), context_length, reward (``reward(prompts, responses)``, see
    ``rollouts.rollout``).
    Raises ``UserError`` (in the constructor) as ``load_policy_and_ref``, ``load_reward_model`` and ``read_prompts``,
    or when ``--rm_weight`` asks for an RM that ``--reward`` does not hold.
    """

    def __init__(self, args, tokenizer, device):
        self.args, self.tokenizer, self.device = args, tokenizer, device
        self.prompts, self.held_out_prompts = read_prompts(args)
        self.policy, parent, self.ref = load_policy_and_ref(args, tokenizer, device)
        self.review_model, self.review_weight = None, 0.0
        if args.verifier:
            self.reward_model, self.context_length = None, self.policy.cfg.context_length
            self.reward = verifier_reward(args.verifier, tokenizer)
            self.parent = {**parent, "verifier": args.verifier}
            check_room(args, self.context_length, "the policy's")
            rm_weight = getattr(args, "rm_weight", 0.0)  # GRPO's flag; PPO's reward is the verifier's alone
            has_rm = os.path.isfile(os.path.join(args.reward, "config.json"))
            reviews = rm_weight and any(review_polarity(t) for t in self.prompts)  # the RM in the reward
            if reviews and not has_rm:
                raise UserError(f"--rm_weight {rm_weight} (given, or the preset's) adds the reward model's score of "
                                f"the 好评/差评 answers to the reward, but --reward {args.reward} holds no checkpoint; "
                                f"train 2-RM.py first, point --reward at one, or give --rm_weight 0 for the verifier "
                                f"alone")
            if reviews or any(asks_for_praise(t) for t in self.held_out_prompts):
                if has_rm:
                    self.review_model = load_reward_model(args, self.policy.cfg.vocab_size, device)
                    if reviews:  # the RM is then part of the reward: the checkpoint records which one
                        self.parent.update(parent_meta(args.reward, "reward"))
                        self.review_weight = float(rm_weight)
                else:
                    print(f"note: no reward model in --reward {args.reward}: the held-out answers are measured by "
                          f"the verifier alone, without the RM score and the judge beside it", flush=True)
        else:
            self.reward_model = load_reward_model(args, self.policy.cfg.vocab_size, device)
            self.context_length = min(self.policy.cfg.context_length, self.reward_model.cfg.context_length)
            self.reward = rm_reward(self.reward_model)
            self.parent = {**parent, **parent_meta(args.reward, "reward")}
            check_room(args, self.context_length, "the shorter of policy and reward model")
        note_if_not_chat(args)

    def rollout(self, policy, prompts, critic=None) -> dict:
        """``policy``'s answers to ``prompts`` and their measurements (``rollouts.rollout``): sampled, then the
        log-probs of the policy and of the reference, the reward, and the values of ``critic`` when given one."""
        return rollout(policy, prompts, ref=self.ref, reward=self.reward, tokenizer=self.tokenizer, args=self.args,
                       context_length=self.context_length, device=self.device, critic=critic)

    def review_scores(self, prompts, responses):
        """How good a review each answer of a rollout is, by the review model, and the polarity of its problem: ((B,)
        float32, 0.0 where not a review; (B,) float32, +1 for a 好评, -1 for a 差评, 0 for no review; the RM's own
        score is their product). ``responses``: a rollout's dict, as every reward takes it.

        The RM scores how positive a review is (its pairs put a positive review above a negative one): on a 好评
        problem that score is the answer's quality, on a 差评 its negative is (``tasks.review_polarity``); counting
        the 好评 alone, GRPO also made the 差评 answers more positive (bench/README.md). One pass scores every row.
        Raises ``AttributeError`` without a ``review_model``."""
        device = responses["input_ids"].device
        polarity = torch.tensor([review_polarity(p) for p in prompts], dtype=torch.float32, device=device)  # (B,)
        return polarity * rm_reward(self.review_model)(prompts, responses), polarity

    def held_out(self, stage, policy):
        """The held-out measurement of this reward's path for ``stage``'s (unwrapped) ``policy``."""
        if self.args.verifier:
            return TaskHeldOut(stage, policy, self.ref, self.held_out_prompts, self.tokenizer, self.args,
                               self.context_length, self.args.verifier, self.review_model, self.review_weight)
        return HeldOut(stage, policy, self.ref, self.reward_model, self.held_out_prompts, self.tokenizer, self.args,
                       self.context_length)


def online_defaults(args, defaults: dict, task_defaults: dict, output_dirs: dict):
    """Fill an online aligner's unset flags: the preset's values of its path (``defaults``, or ``task_defaults``
    with ``--verifier``), the prompt files of that path (``PROMPT_FILES``) and its output folder (``output_dirs``,
    by path: False for preferences, True for the verifier)."""
    path = bool(args.verifier)
    fill_defaults(args, {**(task_defaults if path else defaults)[args.preset], **PROMPT_FILES[path],
                         "output_dir": output_dirs[path]})
    return args
