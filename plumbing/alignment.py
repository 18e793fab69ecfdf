"""What the alignment stages (3-PPO.py, 3-DPO.py, 3-GRPO.py) share about a policy's responses, written once.

* log-probabilities: ``token_logprobs`` of given tokens, ``sequence_logprobs`` of a labelled response (DPO),
  ``masked_mean``, ``entropy_from_logits``, ``kl_per_response``;
* sampling: ``sample_responses`` (batched, left-padded prompts through the chat template and the KV-cached
  ``generate``), ``response_mask_after``, ``rollout`` (the samples with everything an update needs about them),
  ``penalise_unfinished`` (answers cut off without ``[SEP]``);
* monitors: ``monitors_of`` and ``held_out_monitors`` (the RM score beside the independent judge, KL, entropy,
  length, ``[SEP]`` share and repetition, see ``judge.py``), their metrics-row names (``as_val_row``,
  ``from_val_row``), ``describe`` for the console and ``write_samples`` for samples.md.

* set-up: ``add_held_out_arguments`` (the flags of the held-out monitors, the same in all three stages),
  ``read_prompts`` and ``load_policy_and_reward``.

The stage-specific maths (PPO's GAE and clipped losses, DPO's loss, GRPO's group advantages) stays in each stage.
"""

from __future__ import annotations

import copy
import hashlib
import os
import sys

import torch
from accelerate import PartialState

from chinese_tokenizer import EOS_ID, chat_prompt_ids, decode
from gpt_model import generate
from plumbing.batching import pad_left
from plumbing.checkpoint import CHAT_STAGES, load_backbone, load_checkpoint, read_config
from plumbing.cli import UserError, default_path, positive_int
from plumbing.judge import SentimentJudge, reward_hacking_flag, summarize
from plumbing.records import read_prompt_files, shown_prompt
from plumbing.report import markdown_table


def token_logprobs(logits, tokens):
    """log softmax(logits)[token]: (B, T, V), (B, T) -> (B, T), in float32 (bf16 logits would lose the small
    differences between policy and reference that KL and the ratios are made of)."""
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def sequence_logprobs(logits, labels):
    """log pi(response | prompt) per row: the sum of ``token_logprobs`` over the positions whose label is not -100.

    Args:
        logits: (B, T, V), position t predicting ``labels[:, t]`` (labels already shifted, as
            ``corpus.chat_example`` makes them).
        labels: (B, T) next-token ids, -100 on the prompt and on padding.
    Returns:
        (B,) float32 log-probabilities, in nats.
    """
    keep = labels != -100  # (B, T)
    logp = token_logprobs(logits, labels.clamp(min=0))  # (B, T); ignored positions read id 0, then drop out
    return torch.where(keep, logp, 0.0).sum(dim=1)  # (B,); a select, so a non-finite ignored value cannot leak


def masked_mean(x, mask):
    """Mean of ``x`` over positions where ``mask`` is 1 (a scalar). The other positions are set aside with a select,
    not multiplied by 0: an inf or NaN there (a padded position's ratio) would make ``inf * 0 = NaN`` of the mean."""
    return torch.where(mask.bool(), x, 0.0).sum() / mask.sum().clamp(min=1)


def entropy_from_logits(logits):
    """Entropy of softmax(logits) per position: (B, T, V) -> (B, T), in nats."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def kl_per_response(logprobs, ref_logprobs, mask):
    """KL(pi || pi_ref) of each sampled response, in nats: the sum over its real tokens of log pi(a_t) -
    log pi_ref(a_t) at the sampled tokens a_t. (B, R) x 3 -> (B,). Averaged over responses sampled from pi it is an
    unbiased estimate of the KL between the two models' distributions of whole responses; one response's value can
    be negative."""
    return torch.where(mask.bool(), logprobs - ref_logprobs, 0.0).sum(1)


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


def penalise_unfinished(scores, ended, penalty: float):
    """RM scores (B,) minus ``penalty`` for each response that did not end with [SEP] (``ended`` (B,) bool):
    an answer cut off by the token limit is not a finished answer, whatever the RM thinks of its first part."""
    return scores - penalty * (~ended).to(scores.dtype)


def response_mask_after(responses, eos_id: int):
    """(B, R) generated ids -> 0/1 mask of the real response: every token up to and including the first eos."""
    is_eos = (responses == eos_id).long()
    ended_before = is_eos.cumsum(dim=1) - is_eos  # eos tokens strictly before t
    return (ended_before == 0).long()


@torch.no_grad()
def sample_responses(policy, prompts, tokenizer, args, context_length, device):
    """Sample one response per prompt from ``policy`` (batched, left-padded prompts, KV cache).

    Returns (sequences (B, P+R), attention_mask (B, P+R), response_mask (B, R), P): the mask covers each
    response up to and including its first [SEP]; what ``generate`` filled in after it is padding.
    """
    room = context_length - args.max_new_tokens  # the prompt keeps its last tokens so the whole sequence fits
    batch = pad_left([chat_prompt_ids(p, tokenizer, room) for p in prompts])
    query, query_mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)  # (B, P)
    # temperature 1: the samples come from the policy itself, whose log-probs the updates and the KL use
    sequences = generate(policy, query, args.max_new_tokens, context_length, temperature=1.0,
                         eos_id=EOS_ID, attention_mask=query_mask)  # (B, P + R)
    P = query.shape[1]
    response_mask = response_mask_after(sequences[:, P:], EOS_ID)  # (B, R)
    return sequences, torch.cat([query_mask, response_mask], dim=1), response_mask, P


@torch.no_grad()
def rollout(policy, ref, critic, reward_model, prompts, tokenizer, args, context_length, device):
    """Sample responses and compute everything PPO needs about them.

    Returns a dict: input_ids, attention_mask (B, P+R); response_mask, logprobs, ref_logprobs, entropy, values
    (B, R; no values when ``critic`` is None); scores (B,) from the RM; ended (B,) bool, whether the response
    ended with [SEP]; prompt_len P.
    """
    sequences, attention_mask, response_mask, P = sample_responses(policy, prompts, tokenizer, args,
                                                                   context_length, device)
    responses = sequences[:, P:]  # (B, R)
    # logits at position t predict token t + 1: response token j is predicted at column P - 1 + j
    logits = policy(sequences, attention_mask=attention_mask)["logits"][:, P - 1:-1]  # (B, R, V)
    ref_logits = ref(sequences, attention_mask=attention_mask)["logits"][:, P - 1:-1]  # (B, R, V)
    data = {
        "input_ids": sequences, "attention_mask": attention_mask, "response_mask": response_mask.float(),
        "logprobs": token_logprobs(logits, responses), "ref_logprobs": token_logprobs(ref_logits, responses),
        "entropy": entropy_from_logits(logits),  # (B, R)
        "scores": reward_model(sequences, attention_mask)["rewards"].float(),  # (B,)
        "ended": (responses == EOS_ID).any(dim=1),  # (B,)
        "prompt_len": P,
    }
    if critic is not None:
        data["values"] = critic(sequences, attention_mask)["values"][:, P - 1:-1].float()  # (B, R)
    return data


def response_token_lists(data) -> list[list[int]]:
    """Each sampled response's token ids, [SEP] and what follows it removed: what the monitors count."""
    mask, P = data["response_mask"].bool(), data["prompt_len"]
    return [row[m & (row != EOS_ID)].tolist() for row, m in zip(data["input_ids"][:, P:], mask)]


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


def weights_digest(*models) -> str:
    """The sha256 of every parameter and buffer of ``models`` (names, dtypes, shapes and bytes), in order; a tensor
    seen already (a tied head) adds only its name."""
    h, seen = hashlib.sha256(), set()
    for model in models:
        for name, t in model.state_dict().items():
            h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
            if t.numel() and (t.data_ptr(), t.dtype, t.shape) not in seen:
                seen.add((t.data_ptr(), t.dtype, t.shape))
                h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy())
    return h.hexdigest()


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
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        batches = [rollout(policy, ref, None, reward_model, flat[start:start + HELD_OUT_BATCH], tokenizer, args,
                           context_length, device) for start in range(0, len(flat), HELD_OUT_BATCH)]
    monitors, texts = monitors_of(batches, judge, tokenizer)
    scores = torch.cat([data["scores"] for data in batches]).tolist()
    examples = [{"prompt": p, "response": t, "score": round(s, 3)} for p, t, s in zip(flat, texts, scores)]
    return monitors, examples


ROLLOUT_MONITORS = ("judge", "kl", "entropy", "length", "eos_share", "distinct_2", "longest_run")
KL_LIMIT = 3.0  # nats per response: past it the held-out comparison raises the reward-hacking flag (every stage)


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


def record_held_out(stage, name: str, sft: dict, after: dict, examples, eval_samples: int,
                    kl_limit: float = KL_LIMIT, **extra) -> str:
    """The end of every alignment stage, written once: the aligned policy's held-out monitors ``after`` go into
    the last metrics row; the reward-hacking flag compares them with the SFT policy's (``sft``); the stage's
    ``config.json`` results get both (``held_out``), the scores, the gain, the KL and the flag, plus ``extra``;
    samples.md gets the first sample of each held-out prompt (at most 12). ``name`` is the stage ("ppo", ...).
    Returns the flag ("" when nothing looks wrong), printed when raised."""
    stage.metrics.rows[-1].update(as_val_row(after))
    flag = reward_hacking_flag(sft, after, kl_limit)
    stage.results.update({"val_score_sft": sft["rm_score"], f"val_score_{name}": after["rm_score"],
                          "val_score_gain": after["rm_score"] - sft["rm_score"], "kl": after["kl"],
                          "kl_limit": kl_limit, "held_out": {"sft": rounded(sft), name: rounded(after)},
                          "reward_hacking": flag, **extra})
    stage.files["samples.md"] = lambda path: write_samples(path, examples[::eval_samples][:12])
    if flag:
        stage.print(flag)
    return flag


def rounded(monitors: dict) -> dict:
    # 6 places: the report prints 3, and rounding twice (to 4, then 3) could show 0.996 where the log said 0.995
    return {k: round(v, 6) for k, v in monitors.items()}


def describe(m: dict) -> str:
    """One line of held-out monitors for the console."""
    return (f"RM score {m['rm_score']:.3f}, judge {m['judge']:.3f} ± {m['judge_se']:.3f}, KL {m['kl']:.2f}, "
            f"entropy {m['entropy']:.2f}, length {m['length']:.1f}, ends with [SEP] {m['eos_share']:.0%}, "
            f"distinct-2 {m['distinct_2']:.3f}, longest run {m['longest_run']:.1f}")


def write_samples(path, examples):
    """``samples.md``: the PPO policy's held-out answers (the first sample of each prompt) with their RM scores."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(markdown_table(("prompt", "response", "RM score"),
                               [(shown_prompt(e["prompt"]), e["response"], e["score"]) for e in examples]))


# the keys of ``judge.summarize`` with KL and entropy: what the held-out monitors hold (a step-0 row also has DPO's
# val_loss / val_accuracy / val_margin, which are no monitors)
MONITOR_KEYS = ("rm_score", "rm_score_se", "judge", "judge_se", "distinct_2", "longest_run", "eos_share", "length",
                "kl", "kl_se", "entropy")


class HeldOut:
    """The held-out monitors of an alignment stage, one piece for PPO, DPO and GRPO so that all three are measured,
    logged and recorded alike (``held_out_monitors`` does the sampling and the scoring).

    * ``measure(tag)``: the monitors of the policy now, in eval mode (dropout off) and under the stage's autocast
      (the precision of its updates, so scores and KL compare like with like), printed on one line;
    * ``before(first_row)``: step 0, the SFT policy before any update, logged as the ``val_*`` of the step-0 metrics
      row (beside the stage's own ``first_row()``, e.g. DPO's pair metrics); on ``--resume`` read back from that row;
    * ``after(name, sft)``: the aligned policy's monitors, recorded with the SFT ones, the reward-hacking flag and
      the settings they were sampled with (``settings``: what best-of-n must repeat to be compared with them).

    Args:
        stage: the stage's ``training.StageRun``; policy: the unwrapped policy (a ``GPTModel``); ref, reward_model:
            the frozen SFT reference and RM; prompts: the held-out prompts; args: the stage's arguments
            (``eval_samples``, ``max_new_tokens``, ``seed``).
    """

    def __init__(self, stage, policy, ref, reward_model, prompts, tokenizer, args, context_length: int):
        self.stage, self.policy, self.ref, self.reward_model = stage, policy, ref, reward_model
        self.prompts, self.tokenizer, self.args, self.context_length = prompts, tokenizer, args, context_length
        self.judge = SentimentJudge()

    @property
    def settings(self) -> dict:
        return {"prompts": list(self.prompts), "samples_per_prompt": self.args.eval_samples, "temperature": 1.0,
                "max_new_tokens": self.args.max_new_tokens}

    def measure(self, tag: str):
        """(monitors, examples) of the policy as it is now; see ``held_out_monitors``."""
        was_training = self.policy.training
        self.policy.eval()
        with self.stage.accelerator.autocast():
            monitors, examples = held_out_monitors(self.policy, self.ref, self.reward_model, self.judge, self.prompts,
                                                   self.tokenizer, self.args, self.context_length,
                                                   self.stage.accelerator.device, self.args.seed)
        self.policy.train(was_training)
        self.stage.print(f"{tag} on {len(self.prompts)} held-out prompts x {self.args.eval_samples}: "
                         f"{describe(monitors)}")
        return monitors, examples

    def before(self, first_row=None) -> dict:
        """The SFT policy's monitors: measured and logged at step 0 (with ``first_row()``'s values, if given), read
        back from the step-0 row after ``--resume``."""
        if self.stage.step == 0:
            row = first_row() if first_row is not None else {}
            self.stage.log({**row, **as_val_row(self.measure("SFT policy")[0])})
        return {k: v for k, v in from_val_row(self.stage.metrics.rows[0]).items() if k in MONITOR_KEYS}

    def after(self, name: str, sft: dict, kl_limit: float = KL_LIMIT) -> dict:
        """The aligned policy's monitors, recorded by ``record_held_out`` with ``settings``; returns them."""
        monitors, examples = self.measure(f"{name.upper()} policy")
        record_held_out(self.stage, name, sft, monitors, examples, self.args.eval_samples, kl_limit,
                        held_out_settings=self.settings)
        return monitors


def add_held_out_arguments(p, stage: str) -> None:
    """The flags of the held-out monitors, one definition for PPO, DPO and GRPO so that all three are measured
    alike: the RM that scores (``--reward``), the held-out prompts and how their answers are sampled. There is no
    ``--temperature``: every stage samples from the policy itself (temperature 1), because the log-probs it trains
    on and the KL it reports are those of the policy; sampling at another temperature would score one
    distribution and train another."""
    p.add_argument("--reward", default=default_path("checkpoints", "rm"),
                   help="reward model checkpoint (2-RM.py)" + (
                       "" if stage != "DPO" else ": it scores the held-out answers only, DPO never trains on it"))
    p.add_argument("--val_prompts_file", default=default_path("data", "ppo", "val_prompts.jsonl"),
                   help=f"held-out prompts: the monitors (RM score, judge, KL, ...) before and after {stage}")
    p.add_argument("--eval_samples", type=positive_int, help="sampled responses per held-out prompt for the monitors")
    p.add_argument("--max_new_tokens", type=positive_int, help="longest response")


def read_val_prompts(args) -> list:
    """The first ``--eval_examples`` held-out prompts of ``--val_prompts_file`` (strings, or conversations as
    tuples of turns: ``corpus.prompt_of``); ``UserError`` names a bad line."""
    return read_prompt_files(args.val_prompts_file, "--val_prompts_file")[:args.eval_examples]


def read_prompts(args) -> tuple[list, list]:
    """The prompts the policy practises on (``--prompts_file``) and the first ``--eval_examples`` held-out ones
    (``--val_prompts_file``) that measure it. Raises ``UserError`` naming a bad file and line."""
    return read_prompt_files(args.prompts_file, "--prompts_file"), read_val_prompts(args)


def load_policy_and_reward(args, tokenizer, device):
    """The models of an online alignment stage: the SFT policy (``--policy``, train mode, on the CPU for
    ``accelerator.prepare``), a frozen copy of it as the reference and the frozen reward model (``--reward``), both
    in eval mode on ``device``, and the context both can read.

    Returns:
        (policy, parent metadata, ref, reward_model, context_length).
    Raises:
        UserError: a missing or wrong checkpoint, vocabularies that differ, or ``--max_new_tokens`` that leaves no
            room for a prompt.
    """
    policy, parent = load_backbone(args.policy, "--policy", tokenizer, "1-SFT.py")
    ref = copy.deepcopy(policy)  # the SFT model as it is now, before --resume loads the trained policy
    if not os.path.isfile(os.path.join(args.reward, "config.json")):
        raise UserError(f"--reward {args.reward}: no checkpoint there; train the reward model with 2-RM.py first "
                        f"or point --reward at one")
    reward_model, _, _ = load_checkpoint(args.reward, "reward", flag="--reward")
    if reward_model.cfg.vocab_size != policy.cfg.vocab_size:
        raise UserError(f"--reward {args.reward} has vocab_size {reward_model.cfg.vocab_size} but --policy "
                        f"{args.policy} has {policy.cfg.vocab_size}; train both from the same tokenizer")
    for frozen in (ref, reward_model):
        frozen.requires_grad_(False).eval().to(device)
    context_length = min(policy.cfg.context_length, reward_model.cfg.context_length)
    if args.max_new_tokens > context_length - 3:
        raise UserError(f"--max_new_tokens {args.max_new_tokens} leaves no room for a prompt in a context of "
                        f"{context_length} (the shorter of policy and reward model); lower it")
    stage = read_config(args.policy).get("stage")
    if stage not in CHAT_STAGES and PartialState().is_main_process:
        # allowed (an experiment may want it), but the usual slip is to pass checkpoints/pretrain for checkpoints/sft
        print(f"note: --policy {args.policy} is a {stage} checkpoint that has not been fine-tuned on the chat "
              f"template (1-SFT.py), so its answers start from plain continuation", file=sys.stderr)
    return policy, parent, ref, reward_model, context_length
