"""The verifiable path of the online aligners (3-GRPO.py and 3-PPO.py with ``--verifier``): what its held-out
figures are. (Its reward, a verifier's 1 or 0, is ``alignment.verifier_reward``; the checkers are
``verifiers.py``.)

* ``pass_at_k``: the unbiased pass@k of Chen et al. 2021 (the Codex paper) from n samples with c right.
* ``task_monitors``: the summary of a policy's held-out answers (``held_out.measure``): greedy accuracy, sampled
  pass@1 at temperature 1 and pass@k (best-of-k with the verifier as the oracle), each with its standard error
  over problems, per family and over all; KL to the reference, length, the share of answers that end and of
  empty ones, and the lax checker's accuracy beside the strict one (a gap between them is an answer that holds
  the right text among other text); where the RM and the judge read the answers to the problems that ask for a
  好评 (``asks_for_praise``), their scores: what the verifier cannot see, whether a constraint was kept by writing
  worse reviews; and whether the answers' length follows the limit asked for (``length_by_limit``): what a gain
  on "at most N" is, reading N or writing shorter.
* ``describe_tasks``: the console line of those figures; ``generated_answers``, ``answer_text`` and ``solved``:
  generated rows as answers (their text, None when a special token stands in it) and the strict checker's
  verdict on one.
* ``task_hacking_flag``: a verifier can be gamed too (empty answers, answers that never end, format tricks): one
  plain sentence when the monitors of SFT -> aligned model look like it.
"""

from __future__ import annotations

import math

from chinese_tokenizer import EOS_ID, decode
from plumbing.judge import mean_and_se, rank_correlation
from plumbing.rollouts import response_mask_after
from plumbing.verifiers import FAMILIES, check, parse_instruction


def answer_text(ids: list[int], tokenizer) -> str | None:
    """The text of an answer's token ids (up to, not including, its ``[SEP]``), or None when a special token stands
    in it: ``decode`` would drop a stray ``[CLS]``, ``[ANS]``, ``[PAD]`` or ``[MASK]`` and let "六[ANS]三二" pass for
    "六三二", which is not the answer."""
    special = set(tokenizer.all_special_ids)  # a property that rebuilds its list: read it once per answer
    if any(i in special for i in ids):
        return None
    return decode(ids, tokenizer)


def generated_answers(sequences, prompt_len: int, tokenizer):
    """(texts, ended, ids) of generated rows (B, P + R): each response's token ids up to its first [SEP], their
    text (None where a special token stands in it, ``answer_text``) and whether it ended with [SEP]."""
    responses = sequences[:, prompt_len:]
    ended = (responses == EOS_ID).any(dim=1).tolist()
    mask = response_mask_after(responses, EOS_ID).bool() & (responses != EOS_ID)
    ids = [row[m].tolist() for row, m in zip(responses, mask)]
    return [answer_text(r, tokenizer) for r in ids], ended, ids


def solved(task: dict, text: str | None, ended) -> bool:
    """The strict checker's verdict on one generated answer (``generated_answers``): ended with ``[SEP]``, no
    special token in it (``text`` not None), and right by ``verifiers.check``."""
    return bool(ended) and text is not None and check(task["family"], text, task["answer"], task["prompt"])


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


def task_monitors(rows: list[dict], tasks: list[dict], samples: int) -> dict:
    """The verifiable path's summary of the held-out rows (``held_out.measure``: one per answer, greedy and
    sampled at temperature 1, the sampling distribution the policy trains on, judged by the strict checker).

    Returns flat floats, for each scope in ("all", *FAMILIES): ``{scope}_greedy``, ``{scope}_pass1`` (the mean over
    the samples), ``{scope}_pass{k}`` for k in 4, 16 up to ``samples``, each with ``_se`` (the standard error over
    problems, the unit of independence), ``{scope}_lax`` (the sampled answers the lax checker accepts),
    ``{scope}_problems``, ``{scope}_length`` (tokens), ``{scope}_eos_share`` and ``{scope}_kl`` with ``_se``; over
    all again without the prefix: ``kl`` and ``kl_se`` (nats per response, the mean of each problem's answers read
    in depth, ``held_out.READ_SAMPLES``),
    ``entropy``, ``length`` (tokens), ``eos_share``, ``empty_share``, ``problems``, ``samples``; for the "at most N"
    instructions, the length of the answers by limit (``length_by_limit``); where the RM and the judge read the
    answers to the problems that ``asks_for_praise``: ``rm_score``, ``judge`` (P(positive)), each with ``_se``
    over those problems (the mean of each problem's answers they read), and ``praise_problems``.
    """
    greedy = {r["prompt"]: r["right"] for r in rows if r["sample"] < 0}
    sampled = [r for r in rows if r["sample"] >= 0]  # samples rows per problem, in order
    by_problem = [sampled[i * samples:(i + 1) * samples] for i in range(len(tasks))]
    read = [[r for r in answers if "kl" in r] for answers in by_problem]  # the answers read in depth
    kl = [sum(r["kl"] for r in answers) / len(answers) for answers in read]  # per problem
    monitors = {}
    for scope in ("all", *FAMILIES):
        chosen = [i for i, t in enumerate(tasks) if scope == "all" or t["family"] == scope]
        if not chosen:
            continue
        rights = {i: sum(r["right"] for r in by_problem[i]) for i in chosen}
        figures = {"greedy": [float(greedy[i]) for i in chosen],
                   "pass1": [rights[i] / samples for i in chosen],
                   "lax": [sum(r["lax"] for r in by_problem[i]) / samples for i in chosen]}
        for k in (4, 16):
            if k <= samples:
                figures[f"pass{k}"] = [pass_at_k(samples, rights[i], k) for i in chosen]
        for name, values in figures.items():
            monitors[f"{scope}_{name}"], se = mean_and_se(values)
            if name != "lax":
                monitors[f"{scope}_{name}_se"] = se
        monitors[f"{scope}_problems"] = float(len(chosen))
        answers = [r for i in chosen for r in by_problem[i]]
        monitors[f"{scope}_length"] = sum(len(r["ids"]) for r in answers) / len(answers)
        monitors[f"{scope}_eos_share"] = sum(r["ended"] for r in answers) / len(answers)
        monitors[f"{scope}_kl"], monitors[f"{scope}_kl_se"] = mean_and_se([kl[i] for i in chosen])
    monitors["kl"], monitors["kl_se"] = mean_and_se(kl)
    tokens = sum(r["tokens"] for answers in read for r in answers)
    monitors.update(entropy=sum(r["entropy"] for answers in read for r in answers) / max(tokens, 1.0),
                    length=sum(len(r["ids"]) for r in sampled) / len(sampled),
                    eos_share=sum(r["ended"] for r in sampled) / len(sampled),
                    empty_share=sum(r["text"] == "" for r in sampled) / len(sampled),
                    problems=float(len(tasks)), samples=float(samples))
    monitors.update(length_by_limit(tasks, [None if r["text"] is None else len(r["text"]) for r in sampled],
                                    samples))
    rated = [[r for r in answers if "rm_score" in r] for answers in read]
    rated = [answers for answers in rated if answers]
    if rated:
        monitors["rm_score"], monitors["rm_score_se"] = mean_and_se(
            [sum(r["rm_score"] for r in a) / len(a) for a in rated])
        monitors["judge"], monitors["judge_se"] = mean_and_se([sum(r["judge"] for r in a) / len(a) for a in rated])
        monitors["praise_problems"] = float(len(rated))
    return monitors


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
