"""The verifiable path of the online aligners (3-GRPO.py and 3-PPO.py with ``--verifier``): rewards a program checks,
and exact accuracy on held-out problems.

* ``verifier_reward``: a verifier (``verifiers.VERIFIERS``) as a reward, called as the RM's is
  (``reward(prompts, responses)``): 1.0 for a response that ended with ``[SEP]`` and whose text is the answer,
  else 0.0.
* ``pass_at_k``: the unbiased pass@k of Chen et al. 2021 (the Codex paper) from n samples with c right.
* ``measure_tasks``: a policy on held-out problems: greedy accuracy, sampled pass@1 at temperature 1 and pass@k
  (best-of-k with the verifier as the oracle), each with its standard error over problems, per family and over
  all; KL to the reference, length, the share of answers that end and of empty ones, and the lax checker's
  accuracy beside the strict one (a gap between them is an answer that holds the right text among other text);
  given a reward model, the RM score and the judge of the answers to the problems that ask for a 好评
  (``asks_for_praise``): what the verifier cannot see, whether a constraint was kept by writing worse reviews;
  and whether the answers' length follows the limit asked for (``length_by_limit``): what a gain on "at most N"
  is, reading N or writing shorter.
* ``task_rollout_row``, ``describe_tasks``, ``write_task_samples``: what ``alignment.TaskHeldOut`` (this path's
  held-out measurement, on the base it shares with the preference path's ``HeldOut``) logs, prints and writes.
* ``task_hacking_flag``: a verifier can be gamed too (empty answers, answers that never end, format tricks): one
  plain sentence when the monitors of SFT -> aligned model look like it.
"""

from __future__ import annotations

import copy
import math

import torch

from chinese_tokenizer import EOS_ID, chat_prompt_ids, decode
from gpt_fast import generate
from plumbing.batching import pad_left
from plumbing.checkpoint import weights_digest
from plumbing.devices import forked_rng
from plumbing.judge import mean_and_se, rank_correlation
from plumbing.markdown import markdown_table
from plumbing.rollouts import (
    kl_per_response,
    response_logprobs,
    response_mask_after,
    response_token_lists,
)
from plumbing.verifiers import FAMILIES, VERIFIERS, check, contains, parse_instruction


def verifier_reward(name: str, tokenizer):
    """A verifier as a reward: ``reward(tasks, responses)`` -> (B,) float32, the interface of
    ``alignment.rm_reward`` (prompts first, then a rollout's dict, ``rollouts.rollout``). Per response 1.0 when it
    ended with ``[SEP]`` and the verifier ``name`` (``verifiers.VERIFIERS``) accepts its text for the task's answer,
    else 0.0. ``tasks``: the rollout's prompts, task dicts (``records.read_tasks``). An answer cut off by the token
    limit is never right: the answer is the whole response up to ``[SEP]``."""
    verifier = VERIFIERS[name]

    def reward(tasks, responses):
        texts = [answer_text(ids, tokenizer) for ids in response_token_lists(responses)]
        right = [bool(ended) and text is not None and verifier(t["family"], text, t["answer"], t["prompt"])
                 for t, text, ended in zip(tasks, texts, responses["ended"].tolist())]
        return torch.tensor(right, dtype=torch.float32, device=responses["input_ids"].device)
    return reward


def answer_text(ids: list[int], tokenizer) -> str | None:
    """The text of an answer's token ids (up to, not including, its ``[SEP]``), or None when a special token stands
    in it: ``decode`` would drop a stray ``[CLS]``, ``[ANS]``, ``[PAD]`` or ``[MASK]`` and let "六[ANS]三二" pass for
    "六三二", which is not the answer."""
    special = set(tokenizer.all_special_ids)  # a property that rebuilds its list: read it once per answer
    if any(i in special for i in ids):
        return None
    return decode(ids, tokenizer)


def pass_at_k(n: int, c: int, k: int) -> float:
    """The probability that at least one of k samples is right, estimated without bias from n >= k samples of which c
    are right: 1 - C(n - c, k) / C(n, k) (Chen et al. 2021, "Evaluating Large Language Models Trained on Code")."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


LIMIT_BANDS = ((10, 19), (20, 29), (30, 39), (40, 49), (50, 60))  # the card's bands of "at most N characters"


def length_by_limit(tasks, chars, samples: int) -> dict:
    """Whether the answers' length follows the limit asked for: the monitors of the "at most N characters"
    problems among ``tasks``, from ``chars`` (the character count of each sampled answer, ``samples`` rows per
    problem in order; None for an answer with a special token in it). A model that reads N writes longer when N is
    larger; one that only learnt to write short keeps more limits at every N alike.

    Returns:
        {} when no such problem; else ``instruction_chars`` with ``_se`` (the mean answer length in characters,
        SE over problems), ``instruction_chars_{lo}_{hi}`` for each band of ``LIMIT_BANDS`` that holds a limit,
        and over the distinct limits (the unit the held-out split is drawn in) ``instruction_length_rho`` with
        ``_se``, the rank correlation of N with its answers' mean length (``judge.rank_correlation``; from 3
        limits), and ``instruction_limits``.
    """
    per_limit, per_problem = {}, []
    for i, task in enumerate(tasks):
        kind, argument = parse_instruction(task["answer"]) if task["family"] == "instruction" else ("", "")
        counts = [c for c in chars[i * samples:(i + 1) * samples] if c is not None]
        if kind == "max_chars" and counts:
            per_limit.setdefault(int(argument), []).extend(counts)
            per_problem.append(sum(counts) / len(counts))
    if not per_problem:
        return {}
    out = dict(zip(("instruction_chars", "instruction_chars_se"), mean_and_se(per_problem)))
    for lo, hi in LIMIT_BANDS:
        band = [c for n, counts in per_limit.items() if lo <= n <= hi for c in counts]
        if band:
            out[f"instruction_chars_{lo}_{hi}"] = sum(band) / len(band)
    limits = sorted(per_limit)
    if len(limits) >= 3:
        means = [sum(per_limit[n]) / len(per_limit[n]) for n in limits]
        out["instruction_length_rho"], out["instruction_length_rho_se"] = rank_correlation(limits, means)
        out["instruction_limits"] = float(len(limits))
    return out


TASK_BATCH = 64  # problems per generate call of the measurement (x its samples per problem rows)
_MEASURED: dict = {}  # measurements made already in this process (the pipeline measures SFT once for GRPO and PPO)
RM_SAMPLES = 4  # sampled answers per 好评 problem (the first ones) that the RM and the judge score


def asks_for_praise(task: dict) -> bool:
    """Whether a problem asks for a positive review ("写一条不超过二十个字的好评。"): the answers the RM and the judge
    can rank. Both score how positive a review is, so on a 差评 their higher score would be the worse answer."""
    return review_polarity(task) == 1


def review_polarity(task: dict) -> int:
    """+1 when a problem asks for a 好评, -1 for a 差评, 0 otherwise (another family, or a review of neither kind):
    the sign with which a score of how positive a review is (the RM's) counts as the quality of the answer."""
    if task["family"] != "instruction":
        return 0
    return 1 if "好评" in task["prompt"] else -1 if "差评" in task["prompt"] else 0


@torch.no_grad()
def measure_tasks(policy, ref, tasks, tokenizer, samples: int, max_new_tokens: int, context_length: int, device,
                  seed: int, verifier: str = "exact", reward_model=None, judge=None) -> tuple[dict, list[dict]]:
    """Exact accuracy of ``policy`` on ``tasks``: one greedy answer and ``samples`` sampled ones (temperature 1, the
    sampling distribution the policy trains on) per problem, scored by the strict checker (``verifiers.check``).

    Returns:
        (monitors, examples). monitors, flat floats, for each scope in ("all", *FAMILIES): ``{scope}_greedy``,
        ``{scope}_pass1`` (the mean over the samples), ``{scope}_pass{k}`` for k in 4, 16 up to ``samples``, each
        with ``_se`` (the standard error over problems, the unit of independence), ``{scope}_lax`` (the sampled
        answers that merely contain the answer), ``{scope}_problems``, ``{scope}_length`` (tokens),
        ``{scope}_eos_share`` and ``{scope}_kl`` with ``_se``; over all again without the prefix: ``kl`` and
        ``kl_se`` (nats per response, from the first sample of each problem against ``ref``; exactly 0 when the two
        are the same weights), ``length`` (tokens), ``eos_share``, ``empty_share``, ``problems``, ``samples``;
        for the "at most N" instructions, the length of the answers by limit (``length_by_limit``);
        given ``reward_model`` and ``judge`` (``judge.SentimentJudge``) and problems that ``asks_for_praise``:
        ``rm_score``, ``judge`` (P(positive)), each with ``_se`` over those problems (the mean of their first
        ``RM_SAMPLES`` sampled answers each), and ``praise_problems``. examples: the first problems' greedy answers.
    A measurement of the same weights, problems and settings made already in this process is returned again.
    """
    kind = torch.device(device).type
    autocast = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None
    models = (policy, ref) if reward_model is None else (policy, ref, reward_model)
    key = (weights_digest(*models), type(judge).__name__, repr(tasks), samples, max_new_tokens,
           context_length, str(device), seed, verifier, str(autocast))
    if key not in _MEASURED:
        with forked_rng(device):
            torch.manual_seed(seed)
            _MEASURED[key] = _measure(policy, ref, tasks, tokenizer, samples, max_new_tokens, context_length, device,
                                      verifier, same=weights_digest(policy) == weights_digest(ref),
                                      reward_model=reward_model, judge=judge)
    return copy.deepcopy(_MEASURED[key])


def generated_answers(sequences, prompt_len: int, tokenizer):
    """(texts, ended, lengths) of generated rows: each response up to its first [SEP] (None where a special token
    stands in it, ``answer_text``)."""
    responses = sequences[:, prompt_len:]
    ended = (responses == EOS_ID).any(dim=1).tolist()
    mask = response_mask_after(responses, EOS_ID).bool() & (responses != EOS_ID)
    ids = [row[m].tolist() for row, m in zip(responses, mask)]
    return [answer_text(r, tokenizer) for r in ids], ended, [len(r) for r in ids]


def solved(task: dict, text: str | None, ended) -> bool:
    """The strict checker's verdict on one generated answer (``generated_answers``): ended with ``[SEP]``, no
    special token in it (``text`` not None), and right by ``verifiers.check``."""
    return bool(ended) and text is not None and check(task["family"], text, task["answer"], task["prompt"])


def _measure(policy, ref, tasks, tokenizer, samples, max_new_tokens, context_length, device, verifier, same,
             reward_model=None, judge=None):
    lax_check = contains if verifier == "exact" else VERIFIERS[verifier]
    greedy, sampled, lax, kl, lengths, ended_all, empty, examples = [], [], [], [], [], [], [], []
    chars = []  # per sampled answer: its length in characters, what a limit counts
    rm_scores, judged = [], []  # per 好评 problem: the mean over its first RM_SAMPLES answers
    for start in range(0, len(tasks), TASK_BATCH):
        batch = tasks[start:start + TASK_BATCH]
        prompt = pad_left([chat_prompt_ids(t["prompt"], tokenizer, context_length - max_new_tokens) for t in batch])
        ids, mask = prompt["input_ids"].to(device), prompt["attention_mask"].to(device)  # (b, P)
        P = ids.shape[1]
        out = generate(policy, ids, max_new_tokens, context_length, eos_id=EOS_ID, attention_mask=mask)
        texts, ended, _ = generated_answers(out, P, tokenizer)
        greedy += [solved(t, x, e) for t, x, e in zip(batch, texts, ended)]
        examples += [{"prompt": t["prompt"], "answer": t["answer"], "response": "(a special token)" if x is None else x}
                     for t, x in zip(batch, texts)]
        out = generate(policy, ids, max_new_tokens, context_length, temperature=1.0, eos_id=EOS_ID,
                       attention_mask=mask, num_samples=samples)  # (b * samples, P + R)
        texts, ended, length = generated_answers(out, P, tokenizer)
        per_row = [t for t in batch for _ in range(samples)]  # the task of each sampled row
        rows = list(zip(per_row, texts, ended))
        sampled += [[solved(t, x, e) for t, x, e in rows[i:i + samples]] for i in range(0, len(rows), samples)]
        lax += [[x is not None and lax_check(t["family"], x, t["answer"], t["prompt"])
                 for t, x, e in rows[i:i + samples]] for i in range(0, len(rows), samples)]
        lengths += length
        chars += [None if x is None else len(x) for x in texts]
        ended_all += ended
        empty += [x == "" for x in texts]
        if reward_model is not None:
            praised = [i for i, t in enumerate(batch) if asks_for_praise(t)]
            rows = [i * samples + j for i in praised for j in range(min(samples, RM_SAMPLES))]
            if rows:
                chosen = out[rows]  # (n, P + R)
                full = torch.cat([mask[[r // samples for r in rows]], response_mask_after(chosen[:, P:], EOS_ID)], 1)
                per = len(rows) // len(praised)
                rm = reward_model(chosen, full)["rewards"].float().view(len(praised), per).mean(1)  # (problems,)
                js = torch.tensor(judge([texts[r] or "" for r in rows])).view(len(praised), per).mean(1)
                rm_scores += rm.tolist()
                judged += js.tolist()
        if same:
            kl += [0.0] * len(batch)
        else:  # the KL of the first sample of each problem: sum over its tokens of log pi - log pi_ref
            first = out[::samples]
            full_mask = torch.cat([mask, response_mask_after(first[:, P:], EOS_ID)], dim=1)
            response_mask = full_mask[:, P:].float()
            logp = response_logprobs(policy, first, full_mask, response_mask, P)  # (b, R)
            ref_logp = response_logprobs(ref, first, full_mask, response_mask, P)  # (b, R)
            kl += kl_per_response(logp, ref_logp, response_mask).tolist()
    monitors = {}
    for scope in ("all", *FAMILIES):
        rows = [i for i, t in enumerate(tasks) if scope == "all" or t["family"] == scope]
        if not rows:
            continue
        figures = {"greedy": [float(greedy[i]) for i in rows],
                   "pass1": [sum(sampled[i]) / samples for i in rows],
                   "lax": [sum(lax[i]) / samples for i in rows]}
        for k in (4, 16):
            if k <= samples:
                figures[f"pass{k}"] = [pass_at_k(samples, sum(sampled[i]), k) for i in rows]
        for name, values in figures.items():
            monitors[f"{scope}_{name}"], se = mean_and_se(values)
            if name != "lax":
                monitors[f"{scope}_{name}_se"] = se
        monitors[f"{scope}_problems"] = float(len(rows))
        answers = [i * samples + j for i in rows for j in range(samples)]  # the scope's sampled rows
        monitors[f"{scope}_length"] = sum(lengths[r] for r in answers) / len(answers)
        monitors[f"{scope}_eos_share"] = sum(ended_all[r] for r in answers) / len(answers)
        monitors[f"{scope}_kl"], monitors[f"{scope}_kl_se"] = mean_and_se([kl[i] for i in rows])
    monitors["kl"], monitors["kl_se"] = mean_and_se(kl)
    monitors.update(length=sum(lengths) / len(lengths), eos_share=sum(ended_all) / len(ended_all),
                    empty_share=sum(empty) / len(empty), problems=float(len(tasks)), samples=float(samples))
    monitors.update(length_by_limit(tasks, chars, samples))
    if rm_scores:
        monitors["rm_score"], monitors["rm_score_se"] = mean_and_se(rm_scores)
        monitors["judge"], monitors["judge_se"] = mean_and_se(judged)
        monitors["praise_problems"] = float(len(rm_scores))
    return monitors, examples


def describe_tasks(m: dict) -> str:
    """One line of task monitors for the console."""
    families = ", ".join(f"{f} {m[f + '_pass1']:.1%}" for f in FAMILIES if f + "_pass1" in m)
    judged = f", on 好评: RM score {m['rm_score']:.3f}, judge {m['judge']:.3f}" if "rm_score" in m else ""
    return (f"greedy {m['all_greedy']:.1%}, sampled pass@1 {m['all_pass1']:.1%} ± {m['all_pass1_se']:.1%} "
            f"({families}), KL {m['kl']:.2f}, length {m['length']:.1f}, ends with [SEP] {m['eos_share']:.0%}, "
            f"empty {m['empty_share']:.0%}{judged}")


def task_hacking_flag(before: dict, after: dict, kl_limit: float) -> str:
    """"reward hacking suspected: <reasons>." from the task monitors of the SFT policy and the aligned one, "" when
    nothing looks wrong. The reasons: the lax checker's accuracy rose by more than 0.05 beyond the strict one's
    (answers that hold the right text among other text), more empty answers (+0.05), fewer answers that end (-0.15),
    answers more than twice as long, a KL past ``kl_limit`` nats per response, and where both were measured, an RM
    score or a judge lower by more than two standard errors of the difference (a constraint kept by writing worse
    reviews)."""
    reasons = []
    lax_gain, strict_gain = after["all_lax"] - before["all_lax"], after["all_pass1"] - before["all_pass1"]
    if lax_gain - strict_gain > 0.05:
        reasons.append(f"the lax checker's accuracy rose by {lax_gain:.3f}, the strict one's by {strict_gain:.3f}")
    if after["empty_share"] - before["empty_share"] > 0.05:
        reasons.append(f"more empty answers: {before['empty_share']:.0%} -> {after['empty_share']:.0%}")
    if before["eos_share"] - after["eos_share"] > 0.15:
        reasons.append(f"fewer answers end: {before['eos_share']:.0%} -> {after['eos_share']:.0%} end with [SEP]")
    if after["length"] > 2 * max(before["length"], 1.0):
        reasons.append(f"answers grew from {before['length']:.1f} to {after['length']:.1f} tokens")
    if after["kl"] > kl_limit:
        reasons.append(f"KL to the SFT model is {after['kl']:.2f} nats/response, past the limit of {kl_limit:g}")
    for key, name in (("rm_score", "RM score"), ("judge", "judge")):
        if key in before and key in after and \
                before[key] - after[key] > 2 * math.hypot(before[key + "_se"], after[key + "_se"]):
            reasons.append(f"worse reviews: the {name} on 好评 fell from {before[key]:.3f} to {after[key]:.3f}")
    return f"reward hacking suspected: {'; '.join(reasons)}." if reasons else ""


def task_rollout_row(data) -> dict:
    """What a training rollout's metrics row says on this path: the mean reward (the strict accuracy of the
    samples, before any penalty), KL to the reference, entropy, length, the share that ended and the empty ones."""
    ids = response_token_lists(data)
    kl = kl_per_response(data["logprobs"], data["ref_logprobs"], data["response_mask"])
    entropy = (data["entropy"] * data["response_mask"]).sum() / data["response_mask"].sum().clamp(min=1)
    return {"score": data["scores"].mean().item(), "kl": kl.mean().item(), "entropy": entropy.item(),
            "length": sum(map(len, ids)) / len(ids), "eos_share": data["ended"].float().mean().item(),
            "empty_share": sum(not r for r in ids) / len(ids)}


SFT_SAMPLES = 16  # samples per problem of the SFT policy: its pass@16 is best-of-16 with the verifier as the oracle


def write_task_samples(path, examples) -> None:
    """``samples.md`` of the verifiable path: held-out problems, their answers and the policy's greedy ones."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(markdown_table(("problem", "answer", "response"),
                               [(e["prompt"], e["answer"], e["response"]) for e in examples]))
