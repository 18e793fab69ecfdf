"""What the online aligners (3-PPO.py, 3-GRPO.py) share, written once, and the set-up DPO shares with them: the
models, the prompts and the rewards. (Sampling and log-probabilities are in ``rollouts.py``; the held-out
measurement in ``held_out.py``.)

"Reward" names four things in these stages; every figure says which:

* the **RM score**: the reward model's number for an answer (``rm_reward``), what PPO and GRPO maximise on the
  preference path and what the held-out "RM score" is;
* the **verifier**: 1 when a program accepts the answer, else 0 (``verifier_reward``), the reward with
  ``--verifier``; its held-out mean is the exact accuracy (pass@1);
* the **judge**: the independent sentiment classifier (``judge.SentimentJudge``), never trained on, only measured
  beside the other two, so that a policy that fools its reward shows;
* **DPO's implicit reward**: beta * log(pi / pi_ref) of an answer, what 3-DPO.py ranks pairs by; it is never
  computed for a sampled answer.

An online aligner's reward is a list of ``Reward``s (as TRL's reward functions with their weights): each a name, a
weight and a function ``(prompts, responses) -> (B,)`` float32 that is NaN where it does not apply. The RM alone
on the preference path; on the verifiable path the verifier, and with GRPO's ``--rm_weight`` the RM's score of
the reviews (``review_reward``). ``Online.score`` computes them, one column each, right after the rollout.

* rewards: ``Reward``, ``rm_reward``, ``review_reward``, ``verifier_reward``, ``check_rewards`` (a reward that is
  not finite where it must be stops the run before any update);
* set-up: ``add_online_arguments`` (the flags PPO and GRPO share) and ``add_held_out_arguments`` (those all three
  share), ``read_prompts``, ``load_policy_and_ref``, ``load_reward_model``, ``load_policy_and_reward``,
  ``online_defaults`` and ``Online``: an online aligner's policy, reference, prompts, rewards, the monitors of a
  training rollout (``Online.rollout_row``) and its held-out measurement (``Online.held_out``).

The stage-specific maths (PPO's GAE and clipped losses, DPO's loss, GRPO's group advantages) stays in each stage.
"""

from __future__ import annotations

import copy
import os
import sys
from collections.abc import Callable
from typing import NamedTuple

import torch
from accelerate import PartialState

from chinese_tokenizer import decode
from lora import AdaptersOff, add_lora, trainable_parameters
from plumbing.checkpoint import CHAT_STAGES, load_backbone, load_checkpoint, parent_meta, read_config
from plumbing.cli import (
    SAME_SIZE,
    UserError,
    add_lora_arguments,
    default_path,
    fill_defaults,
    non_negative_float,
    positive_float,
    positive_int,
)
from plumbing.held_out import PREFERENCES, SFT_SAMPLES, TASKS, HeldOut
from plumbing.judge import SentimentJudge, summarize
from plumbing.records import read_prompt_files, read_tasks, shown_prompt
from plumbing.rollouts import kl_per_response, response_token_lists, rollout
from plumbing.tasks import answer_text, asks_for_praise, review_polarity
from plumbing.verifiers import VERIFIERS


class Reward(NamedTuple):
    """One term of an online aligner's reward: ``fn(prompts, responses)`` -> (B,) float32, NaN on the rows it
    does not apply to, counted at ``weight``. ``responses`` is a rollout's dict (``rollouts.rollout``)."""
    name: str
    weight: float
    fn: Callable


def check_rewards(rewards, prompts, names) -> None:
    """Stop before any update when a reward is not finite where it must be: one NaN RM score would turn its group's
    advantages (GRPO) or its response's returns (PPO) into NaN, which backward and an optimizer step would spread to
    every weight. The first reward applies to every answer; the others may be NaN (not applicable), never infinite.

    Args:
        rewards: (B, K) the rewards of the responses to ``prompts`` (one prompt per row), column k named names[k].
    Raises:
        UserError: naming the reward, the first prompt whose answer got a bad value, and the likely cause.
    """
    bad = ~torch.isfinite(rewards)
    bad[:, 1:] &= ~torch.isnan(rewards[:, 1:])
    if bad.any():
        i, k = (int(x) for x in bad.nonzero()[0])
        raise UserError(f"the {names[k]} reward of the answer to prompt {shown_prompt(prompts[i])!r} is "
                        f"{rewards[i, k].item()} ({int(bad.sum())} of {bad.numel()} rewards are not finite); the "
                        f"reward model (--reward) is broken: score a few texts with 2-RM.py --score to see, and "
                        f"retrain it")


def rm_reward(reward_model):
    """The reward model as a reward: ``reward(prompts, responses)`` -> (B,) float32. Each response is scored as
    generated, the whole sequence read at its last real token (an unfinished answer has no [SEP]). ``prompts`` are
    not read: the RM reads the tokens."""
    def reward(prompts, responses):
        return reward_model(responses["input_ids"], responses["attention_mask"])["rewards"].float()
    return reward


def review_reward(reward_model):
    """How good a review each answer is, by the reward model (``--rm_weight``): ``reward(prompts, responses)`` ->
    (B,) float32, the RM's score on a 好评 problem, its negative on a 差评 (``tasks.review_polarity``), NaN on any
    other problem. The RM scores how positive a review is (its pairs put a positive review above a negative one),
    so on a 差评 the lower score is the better answer; counting the 好评 alone, GRPO also made the 差评 answers more
    positive (bench/README.md, "Keeping the reviews"). One pass scores every row."""
    def reward(prompts, responses):
        device = responses["input_ids"].device
        polarity = torch.tensor([review_polarity(p) for p in prompts], dtype=torch.float32, device=device)  # (B,)
        scores = rm_reward(reward_model)(prompts, responses)  # (B,)
        return torch.where(polarity != 0, polarity * scores, torch.nan)
    return reward


def verifier_reward(name: str, tokenizer):
    """A verifier as a reward: ``reward(tasks, responses)`` -> (B,) float32, 1.0 for a response that ended with
    ``[SEP]`` and whose text the verifier ``name`` (``verifiers.VERIFIERS``) accepts for the task's answer, else
    0.0. ``tasks``: task dicts (``records.read_tasks``). An answer cut off by the token limit is never right: the
    answer is the whole response up to ``[SEP]``; one with a special token in it neither (``tasks.answer_text``)."""
    verifier = VERIFIERS[name]

    def reward(tasks, responses):
        texts = [answer_text(ids, tokenizer) for ids in response_token_lists(responses)]
        right = [bool(ended) and text is not None and verifier(t["family"], text, t["answer"], t["prompt"])
                 for t, text, ended in zip(tasks, texts, responses["ended"].tolist())]
        return torch.tensor(right, dtype=torch.float32, device=responses["input_ids"].device)
    return reward


def add_online_arguments(p, stage: str) -> None:
    """The flags PPO and GRPO share, defined once: where the policy and its prompts come from, the reward and the
    held-out monitors (``add_held_out_arguments``), LoRA, and the rollout's size, the KL weight, the ratio clip and
    the penalty of an answer that never ends."""
    p.add_argument("--policy", default=default_path("checkpoints", "sft"), help="SFT checkpoint: policy and reference")
    p.add_argument("--prompts_file",
                   help='what the policy answers: .jsonl lines with a "prompt" (or alpaca / "messages" records, '
                        'records.prompt_of) or a .txt file of one prompt per line (default: data/ppo/prompts.jsonl); '
                        'with --verifier problems with answers (default: data/instructions/train.jsonl; the second '
                        'family: data/sentiment/train.jsonl)')
    add_held_out_arguments(p, stage)
    add_lora_arguments(p)
    p.add_argument("--rollout_size", type=positive_int, help="prompts sampled per iteration (per process)")
    p.add_argument("--kl_coef", type=non_negative_float,
                   help="beta, the weight of the KL to the SFT model (default: the preset's)")
    p.add_argument("--cliprange", type=positive_float, default=0.2, help="ratio clip epsilon")
    p.add_argument("--no_eos_penalty", type=non_negative_float, default=1.0,
                   help="subtracted from the reward of a response that reaches --max_new_tokens without [SEP]")


def add_held_out_arguments(p, stage: str) -> None:
    """The flags of the reward and of the held-out monitors, one definition for PPO, DPO and GRPO so that all three
    are measured alike: the RM that scores (``--reward``; PPO and GRPO may take a ``--verifier`` instead), the
    held-out prompts and how their answers are sampled. There is no ``--temperature``: every stage samples from the
    policy itself (temperature 1), because the log-probs it trains on and the KL it reports are those of the
    policy; sampling at another temperature would score one distribution and train another."""
    scores = {"DPO": ": it scores the held-out answers only, DPO never trains on it",
              "PPO": "; with --verifier it scores the held-out answers to 好评 instructions, beside the judge",
              "GRPO": "; with --verifier it scores the held-out answers to 好评 instructions, beside the judge, and "
                      "with --rm_weight the training answers to 好评 and 差评 instructions too, as part of the reward"}
    p.add_argument("--reward", default=default_path("checkpoints", "rm"),
                   help="reward model checkpoint (2-RM.py)" + scores[stage])
    if stage != "DPO":
        p.add_argument("--verifier", choices=sorted(VERIFIERS),
                       help="train on the verifiable tasks instead, rewarded 1 when this checker accepts the answer "
                            "(exact: the whole answer, strictly; contains: a deliberately lax one), and measure "
                            "exact accuracy on held-out problems; the defaults become the review instructions' files "
                            "(data/instructions/) and the preset's values 'with --verifier'")
    p.add_argument("--val_prompts_file",
                   help="held-out prompts: the monitors (RM score, judge, KL, ...) before and after "
                        f"{stage} (default: data/ppo/val_prompts.jsonl" + (
                            "; with --verifier data/instructions/test.jsonl, whose problems no stage trains on)"
                            if stage != "DPO" else ")"))
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
    reference, the prompts it practises on and the held-out ones that measure it, and its list of ``rewards``.

    * With ``--reward`` (preferences): the reward model scores each answer (``rm_reward``); the held-out monitors
      put its score beside the independent judge.
    * With ``--verifier`` (verifiable tasks): a checker gives 1 or 0 (``verifier_reward``), ``reward_model`` is
      None, and the held-out measure is exact accuracy; where problems ask for a review and ``--reward`` holds a
      checkpoint, that RM (``review_model``) reads the answers: those to the held-out 好评 problems beside the
      judge, and given ``rm_weight`` > 0 (GRPO's ``--rm_weight``) those to the training 好评 and 差评 problems too,
      as a second reward (``review_reward``) so that a constraint is not kept by writing worse reviews.

    Attributes: policy, ref, parent (the parent metadata the checkpoint records, with the reward's), prompts,
    held_out_prompts, reward_model, review_model, judge, context_length, rewards (the ``Reward`` list) and weights
    ((K,) their weights).
    Raises ``UserError`` (in the constructor) as ``load_policy_and_ref``, ``load_reward_model`` and ``read_prompts``,
    or when ``rm_weight`` asks for an RM that ``--reward`` does not hold.
    """

    def __init__(self, args, tokenizer, device, rm_weight: float = 0.0):
        self.args, self.tokenizer, self.device = args, tokenizer, device
        self.prompts, self.held_out_prompts = read_prompts(args)
        self.policy, parent, self.ref = load_policy_and_ref(args, tokenizer, device)
        self.reward_model = self.review_model = self.judge = None
        if args.verifier:
            self.context_length = self.policy.cfg.context_length
            self.rewards = [Reward("verifier", 1.0, verifier_reward(args.verifier, tokenizer))]
            self.parent = {**parent, "verifier": args.verifier}
            check_room(args, self.context_length, "the policy's")
            self._load_review_model(args, rm_weight, device)
        else:
            self.reward_model = load_reward_model(args, self.policy.cfg.vocab_size, device)
            self.context_length = min(self.policy.cfg.context_length, self.reward_model.cfg.context_length)
            self.rewards = [Reward("rm", 1.0, rm_reward(self.reward_model))]
            self.parent = {**parent, **parent_meta(args.reward, "reward")}
            self.judge = SentimentJudge()
            check_room(args, self.context_length, "the shorter of policy and reward model")
        self.weights = torch.tensor([r.weight for r in self.rewards], device=device)  # (K,)
        note_if_not_chat(args)

    @property
    def scorers(self) -> tuple:
        """The models it runs besides the policy (the reference, the reward models), None where it has none."""
        return self.ref, self.reward_model, self.review_model

    def _load_review_model(self, args, rm_weight: float, device) -> None:
        """The RM of the verifiable path: it reads the held-out 好评 answers, and is a reward at ``rm_weight``."""
        has_rm = os.path.isfile(os.path.join(args.reward, "config.json"))
        reviews = rm_weight and any(review_polarity(t) for t in self.prompts)  # the RM in the reward
        if reviews and not has_rm:
            raise UserError(f"--rm_weight {rm_weight} (given, or the preset's) adds the reward model's score of "
                            f"the 好评/差评 answers to the reward, but --reward {args.reward} holds no checkpoint; "
                            f"train 2-RM.py first, point --reward at one, or give --rm_weight 0 for the verifier "
                            f"alone")
        if not (reviews or any(asks_for_praise(t) for t in self.held_out_prompts)):
            return
        if not has_rm:
            print(f"note: no reward model in --reward {args.reward}: the held-out answers are measured by the "
                  f"verifier alone, without the RM score and the judge beside it", flush=True)
            return
        self.review_model = load_reward_model(args, self.policy.cfg.vocab_size, device)
        self.judge = SentimentJudge()
        if reviews:  # the RM is then part of the reward: the checkpoint records which one
            self.parent.update(parent_meta(args.reward, "reward"))
            self.rewards.append(Reward("rm_review", float(rm_weight), review_reward(self.review_model)))

    def rollout(self, policy, prompts, samples: int = 1, critic=None) -> dict:
        """``policy``'s ``samples`` answers to each of ``prompts`` and their log-probs under the policy and the
        reference (``rollouts.rollout``), with the values of ``critic`` when given one; no reward."""
        return rollout(policy, prompts, ref=self.ref, tokenizer=self.tokenizer, args=self.args,
                       context_length=self.context_length, device=self.device, samples=samples, critic=critic)

    @torch.no_grad()
    def score(self, data):
        """Every reward of the list on a rollout's answers: (B, K) float32, column k ``rewards[k]``, NaN where it
        does not apply. Raises ``UserError`` where a reward is not finite and should be (``check_rewards``)."""
        rewards = torch.stack([r.fn(data["prompts"], data) for r in self.rewards], dim=1)  # (B, K)
        check_rewards(rewards, data["prompts"], [r.name for r in self.rewards])
        return rewards

    def rollout_row(self, data, rewards) -> dict:
        """What a training rollout's metrics row says: the mean of the first reward (before any penalty), KL to
        the reference, entropy, length, the shares that ended and that are empty, repetition, and where they
        are known, the judge and the RM's own score of the 好评 and of the 差评 answers."""
        ids = response_token_lists(data)
        kl = kl_per_response(data["logprobs"], data["ref_logprobs"], data["response_mask"])  # (B,)
        judged = ([0.0] * len(ids) if self.reward_model is None  # the judge reads the preference path's answers
                  else self.judge([decode(r, self.tokenizer) for r in ids]))
        monitors = summarize(ids, data["ended"].tolist(), rewards[:, 0].tolist(), judged)
        row = {"score": monitors["rm_score"], "kl": kl.mean().item(),
               "entropy": ((data["entropy"] * data["response_mask"]).sum()
                           / data["response_mask"].sum().clamp(min=1)).item(),
               **{k: monitors[k] for k in ("length", "eos_share", "distinct_2", "longest_run")},
               "empty_share": sum(not r for r in ids) / len(ids)}
        if self.reward_model is not None:
            row["judge"] = monitors["judge"]
        if len(self.rewards) > 1:  # the RM's own score of the reviews (review_reward), by the side asked for
            polarity = torch.tensor([review_polarity(p) for p in data["prompts"]], device=rewards.device)  # (B,)
            row.update({f"rm_score_{side}": (rewards[:, 1] * polarity)[polarity == sign].mean().item()
                        for side, sign in (("praise", 1), ("complaint", -1)) if (polarity == sign).any()})
        return row

    def held_out(self, stage, policy) -> HeldOut:
        """The held-out measurement of this reward's path for ``stage``'s (unwrapped) ``policy``: exact accuracy
        of ``tasks.SFT_SAMPLES`` (SFT) and ``--eval_samples`` answers per problem with ``--verifier``, else the RM
        score beside the judge."""
        if self.args.verifier:
            return HeldOut(stage, policy, self.ref, self.held_out_prompts, self.tokenizer, self.args,
                           self.context_length, TASKS, reward_model=self.review_model, judge=self.judge,
                           verifier=self.args.verifier, sft_samples=SFT_SAMPLES,
                           settings={"families": sorted({t["family"] for t in self.held_out_prompts}),
                                     "rm_weight": sum(r.weight for r in self.rewards[1:])})
        return HeldOut(stage, policy, self.ref, self.held_out_prompts, self.tokenizer, self.args,
                       self.context_length, PREFERENCES, reward_model=self.reward_model, judge=self.judge)


def online_defaults(args, defaults: dict, task_defaults: dict, output_dirs: dict):
    """Fill an online aligner's unset flags: the preset's values of its path (``defaults``, or ``task_defaults``
    with ``--verifier``; a preset a table lacks takes the values of the preset of its size, ``cli.SAME_SIZE``),
    the prompt files of that path (``PROMPT_FILES``) and its output folder (``output_dirs``, by path: False for
    preferences, True for the verifier)."""
    path = bool(args.verifier)
    table = task_defaults if path else defaults
    fill_defaults(args, {**table.get(args.preset, table.get(SAME_SIZE.get(args.preset), {})), **PROMPT_FILES[path],
                         "output_dir": output_dirs[path]})
    return args
