"""The review corpus shared by three stages without overlap: the reward model's preference pairs, the SFT
review-writing pairs and the PPO prompts, with the RM test reviews kept out of everything else."""

from __future__ import annotations

import re

from prep.parsers import clean_line, normalize_newlines
from prep.splits import assign_split, dedupe, hash_sorted, near_duplicate_groups, pick, unit_hash

RM_TEST, RM_VAL = 0.10, 0.05  # shares of the review groups held out for the RM's test and validation
REVIEW_MIN_CHARS, REVIEW_MAX_CHARS = 8, 120
PPO_VAL_PROMPTS = 48
GOOD_REVIEW_PROMPTS = ["写一条好评：", "请写一条正面的用户评价。", "写一段满意的购物或住宿评价。",
                       "用几句话写一条好评。"]
BAD_REVIEW_PROMPTS = ["写一条差评：", "请写一条负面的用户评价。", "写一段不满意的购物或住宿评价。",
                      "用几句话写一条差评。"]
GOOD_OPENING_PROMPTS = ["写一条以“{o}”开头的好评。", "写一条好评，开头是“{o}”。"]
BAD_OPENING_PROMPTS = ["写一条以“{o}”开头的差评。", "写一条差评，开头是“{o}”。"]


def opening_of(review: str) -> str:
    """The first 2–5 characters of a review (length fixed by its hash), used in prompts asking to begin with it."""
    n = 2 + int(unit_hash(review, "opening") * 4)
    return review[:n].rstrip("，,。.！!？?、 ") or review[:n]


def opening_prompt(templates: list[str], review: str, salt: str) -> str | None:
    """A prompt asking for a review that starts like ``review``; None when the review does not start with a
    Chinese character (an opening such as ">三" or "2G" makes a poor prompt)."""
    if not re.match(r"[\u4e00-\u9fff]", review):
        return None
    return pick(templates, review, salt).format(o=opening_of(review))


_LIST_MARK = re.compile(r"^(\d{1,2}|[一二三四五六七八九十])\s*[、.．:：)）]\s*|^\d{1,2}\s+(?=\D)")


def clean_review(line: str) -> str:
    """One review line: whitespace as in ``clean_line``, and a leading list number ("2、", "3.", "1 ") removed
    (the corpus splits numbered pros/cons lists into lines)."""
    return _LIST_MARK.sub("", clean_line(line), count=1).strip()


def usable_reviews(text: str) -> list[str]:
    """Unique one-line reviews of ``REVIEW_MIN_CHARS``..``REVIEW_MAX_CHARS`` characters with 4+ CJK characters."""
    out = []
    for line in dedupe(clean_review(x) for x in normalize_newlines(text).split("\n")):
        if REVIEW_MIN_CHARS <= len(line) <= REVIEW_MAX_CHARS and len(re.findall(r"[\u4e00-\u9fff]", line)) >= 4:
            out.append(line)
    return out


def build_reviews(pos_text: str, neg_text: str) -> dict:
    """Reviews -> RM pairs, SFT review-writing pairs and PPO prompts, keeping the RM test reviews unseen.

    Each unique review line (lines found in both files dropped) goes by hash to RM ``test`` (10%), ``val`` (5%) or
    ``train``; the hash is that of its near-duplicate group (``near_duplicate_groups``), so that a truncated or
    re-punctuated copy of a test review never lands in a training split. RM pairs zip the positive and negative lines of
    a split, each in hash order. RM-train lines are halved by a second hash: one half feeds the SFT review tasks, the
    other the PPO prompts (openings of both positive and negative reviews, to be written as a 好评); the whole
    lines of that half answer no other prompt, so the verifiable instructions take their SFT examples from them
    (``instructions.build_instructions``). PPO validation prompts come from RM-val lines. Every line of the RM test
    and val splits, paired or not, is returned as ``held_out_reviews``: reviews no stage trains on, which the
    sentiment family's held-out problems quote.

    Returns:
        ``{"rm": {split: [record]}, "sft_units": {line: [(prompt, response)]}, "ppo": [record],
        "ppo_val": [record], "ppo_reviews": [(line, positive?)], "held_out_reviews": {"test" | "val": [(line,
        positive?)]}, "counts": {...}}``.
    """
    pos, neg = usable_reviews(pos_text), usable_reviews(neg_text)
    both = set(pos) & set(neg)
    pos = [x for x in pos if x not in both]
    neg = [x for x in neg if x not in both]
    group = near_duplicate_groups(pos + neg)
    split = {}
    for line in pos + neg:
        split[line] = assign_split(group[line], "review", [("test", RM_TEST), ("val", RM_VAL)], "train")
    rm = {}
    for name in ("train", "val", "test"):
        p = hash_sorted([x for x in pos if split[x] == name], "pair-pos")
        n = hash_sorted([x for x in neg if split[x] == name], "pair-neg")
        rm[name] = [{"prompt": pick(GOOD_REVIEW_PROMPTS, c + r, "rm-prompt"), "chosen": c, "rejected": r}
                    for c, r in zip(p, n)]
    pos_set = set(pos)
    sft_units: dict[str, list[tuple[str, str]]] = {}
    ppo_prompts: list[str] = []
    ppo_reviews: list[tuple[str, bool]] = []
    for line in hash_sorted([x for x in pos + neg if split[x] == "train"], "review-use"):
        good = line in pos_set
        if unit_hash(line, "sft-or-ppo") < 0.5:
            prompt = None
            if unit_hash(line, "with-opening") >= 0.5:
                prompt = opening_prompt(GOOD_OPENING_PROMPTS if good else BAD_OPENING_PROMPTS, line, "review-template")
            if prompt is None:
                prompt = pick(GOOD_REVIEW_PROMPTS if good else BAD_REVIEW_PROMPTS, line, "review-template")
            sft_units[line] = [(prompt, line)]
        else:
            ppo_reviews.append((line, good))
            prompt = opening_prompt(GOOD_OPENING_PROMPTS, line, "ppo-template")
            if prompt is not None:
                ppo_prompts.append(prompt)
    ppo_prompts = dedupe(ppo_prompts)
    taken = set(ppo_prompts)
    ppo_val = []
    for line in hash_sorted([x for x in pos + neg if split[x] == "val"], "ppo-val"):
        prompt = opening_prompt(GOOD_OPENING_PROMPTS, line, "ppo-template")
        if prompt is not None and prompt not in taken:
            taken.add(prompt)
            ppo_val.append(prompt)
        if len(ppo_val) == PPO_VAL_PROMPTS:
            break
    counts = {"positive_lines": len(pos), "negative_lines": len(neg), "in_both_dropped": len(both),
              "near_duplicate_groups": len(set(group.values()))}
    return {"rm": rm, "sft_units": sft_units, "ppo": [{"prompt": p} for p in ppo_prompts],
            "ppo_val": [{"prompt": p} for p in ppo_val], "ppo_reviews": ppo_reviews, "counts": counts,
            "held_out_reviews": {name: [(x, x in pos_set) for x in pos + neg if split[x] == name]
                                 for name in ("test", "val")}}
