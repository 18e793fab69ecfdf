"""Verifiable instructions on the review prompts: "写一条不超过二十个字的差评。", "写一条至少三十个字的好评。", in the
manner of IFEval's length constraints (Zhou et al. 2023) and Tülu 3's RLVR prompts. A program checks each one
exactly (``plumbing/verifiers.py``, ``check_instruction``); the SFT examples are real reviews that keep their
instruction, and the held-out problems use limits that no training instruction holds.

The limit is written in Chinese numerals, "二十八", as a reader would write it. The tokenizer reads "28" as one
token of its own: a held-out limit would be a token the model never saw in an instruction, and the demo model
did not learn to tell 28 from 63 (its answers were about 40 characters long whatever the limit, bench/README.md).
"二十八" is three tokens, 二 十 八, each seen in training limits: the tens digit alone says roughly how long.

Why limits and not words to mention: measured on the demo model (bench/README.md), an SFT model asked to mention a
word wrote it in under 1% of its samples, held-out words or training words alike, even after 200 updates on those
examples alone: copying a word from the prompt is beyond it within the pipeline's budget, and RL cannot reinforce
what it never samples. Length instructions it keeps 15-60% of the time, problem by problem spread out."""

from __future__ import annotations

import sys
from pathlib import Path

from prep.splits import assign_split, hash_sorted, pick, unit_hash

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for plumbing/verifiers.py

from plumbing.verifiers import check_instruction  # noqa: E402  (standard library only, like this package)

SENTIMENT = {True: "好评", False: "差评"}
TEMPLATES = {
    "max_chars": ["写一条不超过{n}个字的{s}。", "写一条{s}，{n}个字以内。", "用不超过{n}个字写一条{s}。",
                  "写一条{s}，不要超过{n}个字。"],
    "min_chars": ["写一条至少{n}个字的{s}。", "写一条{s}，不少于{n}个字。", "用至少{n}个字写一条{s}。",
                  "写一条{s}，至少写{n}个字。"],
}
LIMITS = range(10, 81)  # the limits in characters (the reviews' median length is 38, the checker's bounds 8-120)
SLACK = 10  # an SFT example's limit is at most this many characters from its review's length
HELD_OUT_LIMITS = [("test", 0.45), ("val", 0.15)]  # shares of the limits, per kind, kept out of training
HELD_OUT_PROBLEMS = {"test": 250, "val": 100}  # held-out problems per kind (500 in test: the card's floor)
SFT_EXAMPLES = 1000  # SFT examples per kind, at most


DIGITS = "零一二三四五六七八九"


def chinese_numeral(n: int) -> str:
    """1..99 in Chinese numerals as written in prose: 8 "八", 10 "十", 15 "十五", 20 "二十", 28 "二十八"."""
    if not 1 <= n <= 99:
        raise ValueError(f"limits are 1..99 characters, got {n}")
    tens, ones = divmod(n, 10)
    return (DIGITS[tens] if tens > 1 else "") + ("十" if tens else "") + (DIGITS[ones] if ones else "")


def prompts(kind: str, limit: int) -> list[str]:
    """Every wording of the instruction ``kind`` with ``limit``, for a 好评 and for a 差评: 8 prompts."""
    return [t.format(n=chinese_numeral(limit), s=SENTIMENT[good]) for good in (True, False) for t in TEMPLATES[kind]]


def fitting_limits(kind: str, length: int, limits: list[int]) -> list[int]:
    """The ``limits`` a review of ``length`` characters keeps within ``SLACK``: at or above its length for
    ``max_chars``, at or below it for ``min_chars``. A limit far from the length would teach little ("at most 60"
    answered by 12 characters says nothing of what 60 means)."""
    if kind == "max_chars":
        return [n for n in limits if length <= n <= length + SLACK]
    return [n for n in limits if length - SLACK <= n <= length]


def sft_pairs(reviews: list[tuple[str, bool]], train_limits: dict[str, list[int]]) -> list[tuple[str, str]]:
    """(prompt, review) pairs whose review keeps the prompt's instruction (``check_instruction`` says so): each
    review, in order, answers one instruction of a kind chosen by its hash, with a training limit that fits it
    (``fitting_limits``), until each kind has ``SFT_EXAMPLES``."""
    made, out = dict.fromkeys(TEMPLATES, 0), []
    for review, good in reviews:
        kind = sorted(TEMPLATES)[int(unit_hash(review, "instruction-kind") * len(TEMPLATES))]
        fits = fitting_limits(kind, len(review), train_limits[kind])
        if made[kind] >= SFT_EXAMPLES or not fits:
            continue
        limit = fits[int(unit_hash(review, "instruction-limit") * len(fits))]
        template = pick(TEMPLATES[kind], review, "instruction-template")
        if check_instruction(review, f"{kind}:{limit}"):
            made[kind] += 1
            out.append((template.format(n=chinese_numeral(limit), s=SENTIMENT[good]), review))
    return out


def build_instructions(reviews: list[tuple[str, bool]]) -> dict:
    """The instruction family: ``{"test", "val", "train": [{"prompt", "answer", "family"}], "sft": [(prompt,
    response)]}``.

    For each kind, the limits of ``LIMITS`` go by hash to test (45%), val (15%) or train, so that no held-out
    limit is in a training instruction of its kind. Train holds every wording of every training instruction, for
    RL; the held-out splits ``HELD_OUT_PROBLEMS`` of theirs per kind, in hash order. The SFT pairs answer training
    instructions with ``reviews``, (review, positive?) pairs of training reviews no other SFT example answers with.
    """
    split_of = {(kind, n): assign_split(f"{kind}:{n}", "instruction-limit", HELD_OUT_LIMITS, "train")
                for kind in TEMPLATES for n in LIMITS}
    problems = {"train": [], "val": [], "test": []}
    for (kind, n), split in split_of.items():
        problems[split] += [{"prompt": p, "answer": f"{kind}:{n}", "family": "instruction"} for p in prompts(kind, n)]
    out = {"train": problems["train"]}
    for split, count in HELD_OUT_PROBLEMS.items():
        out[split] = [row for kind in TEMPLATES for row in hash_sorted(
            [r for r in problems[split] if r["answer"].startswith(kind + ":")], f"instruction-{split}",
            key=lambda r: r["prompt"])[:count]]
    train_limits = {kind: [n for n in LIMITS if split_of[kind, n] == "train"] for kind in TEMPLATES}
    out["sft"] = sft_pairs(reviews, train_limits)
    return out
