"""Verifiable instructions on the review prompts: "写一条不超过二十个字的差评。", in the manner of IFEval's length
constraints (Zhou et al. 2023) and Tülu 3's RLVR prompts. A program checks each one exactly (``plumbing/verifiers.py``,
``check_instruction``); the SFT examples are real reviews that keep their instruction, and the held-out problems use
limits that no training instruction holds.

The limit is written in Chinese numerals, "二十八", as a reader would write it. The tokenizer reads "28" as one
token of its own: a held-out limit would be a token the model never saw in an instruction. "二十八" is three tokens,
二 十 八, each seen in training limits.

Why "at most N characters" alone, measured on the demo model (bench/README.md): an SFT model asked to mention a word
or to begin with a phrase wrote it in under 1% of its samples (copying from the prompt is beyond it within the
pipeline's budget, and RL cannot reinforce what it never samples); asked for "at least N" beside "at most N", its
answers were as long whatever the kind and the limit, and GRPO could only trade one kind for the other. "At most N"
with N from 10 to 60 it keeps about half the time, problem by problem spread out (short limits rarely, long ones
mostly), and GRPO teaches it to keep them on held-out limits.

The second family (``build_sentiment``, written to ``sentiment/``) asks whether a review it quotes is 正面 or 负面
(positive or negative): the review-polarity task of Pang et al. 2002 as a verifiable problem, the label the corpus's.
Its held-out reviews are the RM's test and val reviews, in no file any stage trains on (nor a near-duplicate of
one: the same text up to punctuation and case; ``data/prepare.py`` counts them). It avoids the words 好评/差评,
which in the other prompts ask for a review to be written.
The pipeline mixes its SFT examples into the one SFT and trains GRPO on it in a stage of its own: mixed into the
instructions' GRPO stage it cost minutes the budget does not have and taught little beyond the answer's form
(bench/README.md, "A second family")."""

from __future__ import annotations

import sys
from pathlib import Path

from prep.splits import hash_sorted, near_dup_form, pick, unit_hash

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for plumbing/verifiers.py

from plumbing.verifiers import check_instruction  # noqa: E402  (standard library only, like this package)

SENTIMENT = {True: "好评", False: "差评"}
TEMPLATES = {
    "max_chars": ["写一条不超过{n}个字的{s}。", "写一条{s}，{n}个字以内。", "用不超过{n}个字写一条{s}。",
                  "写一条{s}，不要超过{n}个字。", "写一条{s}，最多{n}个字。", "写一条最多{n}个字的{s}。",
                  "请用{n}个字以内写一条{s}。", "写一条{n}个字以内的{s}。", "写一条{s}，控制在{n}个字以内。",
                  "写一条{s}，不能超过{n}个字。"],
}
LIMITS = range(10, 61)  # the limits in characters (the reviews' median length is 38, the checker's bounds 8-120)
SLACK = 10  # an SFT example's limit is at most this many characters from its review's length
HELD_OUT_LIMITS = {"test": 25, "val": 8}  # limits per kind kept out of training: 25 x 20 prompts = the card's 500
SFT_EXAMPLES = 1500  # SFT examples per kind, at most

SENTIMENT_TEMPLATES = ["这条评论是正面的还是负面的？“{r}”", "判断这条评论的态度，正面还是负面：{r}",
                       "“{r}”——这条评论是正面还是负面？", "下面这条评论是正面的还是负面的？{r}"]
POLARITY = {True: "正面", False: "负面"}  # not 好评/差评: those words ask for a review in the other prompts
SENTIMENT_LENGTHS = (8, 60)  # characters of a quoted review: the prompt stays short, the answer is two characters
SENTIMENT_SPLITS = {"test": 500, "val": 100, "train": 400, "sft": 1000}  # reviews per split, in this order

DIGITS = "零一二三四五六七八九"


def chinese_numeral(n: int) -> str:
    """1..99 in Chinese numerals as written in prose: 8 "八", 10 "十", 15 "十五", 20 "二十", 28 "二十八"."""
    if not 1 <= n <= 99:
        raise ValueError(f"limits are 1..99 characters, got {n}")
    tens, ones = divmod(n, 10)
    return (DIGITS[tens] if tens > 1 else "") + ("十" if tens else "") + (DIGITS[ones] if ones else "")


def prompts(kind: str, limit: int) -> list[str]:
    """Every wording of the instruction ``kind`` with ``limit``, for a 好评 and for a 差评: 20 prompts."""
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
        prompt = pick(TEMPLATES[kind], review, "instruction-template").format(n=chinese_numeral(limit),
                                                                            s=SENTIMENT[good])
        if check_instruction(review, f"{kind}:{limit}", prompt):
            made[kind] += 1
            out.append((prompt, review))
    return out


def build_sentiment(reviews: list[tuple[str, bool]], held_out: dict[str, list[tuple[str, bool]]],
                    seen: set[str]) -> dict:
    """The sentiment family: ``{"test", "val", "train": [{"prompt", "answer", "family"}], "sft": [{"prompt",
    "response"}]}``, ``SENTIMENT_SPLITS`` reviews each of ``SENTIMENT_LENGTHS`` characters, taken in hash order:
    the held-out splits from ``held_out["test"]`` and ``held_out["val"]`` (the RM's test and val reviews, which no
    stage trains on: not the RM, whose training pairs hold the other reviews, nor SFT, nor PPO), the training ones
    from ``reviews`` ((review, positive?) pairs). A review whose near-duplicate form (``near_dup_form``) is in
    ``seen`` (the answers of other SFT examples) or taken by an earlier split is left out: its label would have
    been shown in training, or one review would sit in two splits."""
    lo, hi = SENTIMENT_LENGTHS
    pools = {"test": held_out["test"], "val": held_out["val"], "train": reviews, "sft": reviews}
    seen_forms, out = {near_dup_form(r) for r in seen}, {split: [] for split in SENTIMENT_SPLITS}
    for split, n in SENTIMENT_SPLITS.items():  # held-out splits first, then the training ones
        usable = hash_sorted([(r, good, near_dup_form(r)) for r, good in pools[split] if lo <= len(r) <= hi],
                             "sentiment-split", key=lambda x: x[0])
        taken = dict.fromkeys(POLARITY, 0)  # half each: always answering one of them scores 50%
        for review, good, form in usable:
            if taken[good] < n // 2 and form not in seen_forms:
                seen_forms.add(form)  # one review per form across all splits
                taken[good] += 1
                out[split].append((pick(SENTIMENT_TEMPLATES, review, "sentiment-template").format(r=review),
                                   POLARITY[good]))
        if min(taken.values()) < n // 2:
            raise ValueError(f"the sentiment family's {split} split found {taken} reviews of each label, not {n // 2}")
    problems = {split: [{"prompt": p, "answer": a, "family": "sentiment"} for p, a in out[split]]
                for split in ("test", "val", "train")}
    return {**problems, "sft": [{"prompt": p, "response": a} for p, a in out["sft"]]}


def quoted_review(prompt: str) -> str:
    """The review a sentiment problem quotes: its prompt without the words of its template
    (``SENTIMENT_TEMPLATES``). Raises ``ValueError`` for a prompt no template writes."""
    for template in SENTIMENT_TEMPLATES:
        head, tail = template.split("{r}")
        if prompt.startswith(head) and prompt.endswith(tail) and len(prompt) > len(head) + len(tail):
            return prompt[len(head):len(prompt) - len(tail)]
    raise ValueError(f"not a sentiment problem: {prompt!r}")


def build_instructions(reviews: list[tuple[str, bool]], held_out: dict[str, list[tuple[str, bool]]],
                       seen: set[str] = frozenset()) -> dict:
    """The two families on the reviews, each ``{"test", "val", "train": [{"prompt", "answer", "family"}], "sft":
    [{"prompt", "response"}]}``: ``{"instructions": ..., "sentiment": ...}``. The sentiment family
    (``build_sentiment``) quotes ``held_out`` reviews in its held-out problems (``{"test" | "val": [(review,
    positive?)]}``, reviews no stage trains on) and keeps them apart from ``seen`` (the review answers of other SFT
    examples) and from the instruction family's SFT answers.

    For each kind, the limits of ``LIMITS`` in hash order go to test (the first ``HELD_OUT_LIMITS["test"]``), val
    (the next ``HELD_OUT_LIMITS["val"]``) or train, so that no held-out limit is in a training instruction of its
    kind; each split holds every wording of its instructions (``prompts``). The SFT pairs answer training
    instructions with ``reviews``, (review, positive?) pairs of training reviews no other SFT example answers with.
    """
    split_of, test, val = {}, HELD_OUT_LIMITS["test"], HELD_OUT_LIMITS["val"]
    for kind in TEMPLATES:
        order = hash_sorted(LIMITS, f"instruction-limit-{kind}", key=str)  # the held-out limits first, by hash
        split_of.update({(kind, n): "test" if i < test else "val" if i < test + val else "train"
                         for i, n in enumerate(order)})
    out = {"train": [], "val": [], "test": []}
    for kind, n in sorted(split_of):
        out[split_of[kind, n]] += [{"prompt": p, "answer": f"{kind}:{n}", "family": "instruction"}
                                   for p in prompts(kind, n)]
    train_limits = {kind: [n for n in LIMITS if split_of[kind, n] == "train"] for kind in TEMPLATES}
    pairs = sft_pairs(reviews, train_limits)
    return {"instructions": {**out, "sft": [{"prompt": p, "response": r} for p, r in pairs]},
            "sentiment": build_sentiment(reviews, held_out, set(seen) | {review for _, review in pairs})}
