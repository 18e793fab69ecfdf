"""The SFT pairs of three families, one unit each (a word, a riddle, a question), and the split of every family's
units (``split_sft``); the fourth family, writing reviews, comes from ``reviews.build_reviews``."""

from __future__ import annotations

import re

from prep.parsers import clean_line
from prep.splits import assign_split, hash_sorted, pick

SFT_VAL = 0.05  # the share of units (words, riddles, questions, reviews) held out for validation
# Per-family caps on SFT units (the demo SFT run must stay short on 2 CPU cores).
SFT_CAPS = {"definition": 6000, "xiehouyu": 4000, "chat": 100000, "review": 3000}
MAX_RESPONSE_CHARS = 120
DEFINITION_TEMPLATES = ["解释词语：{w}", "“{w}”是什么意思？", "请解释一下“{w}”这个词。", "{w}的意思是什么？",
                        "词语“{w}”怎么理解？"]
XIEHOUYU_TEMPLATES = ["歇后语“{r}”的后半句是什么？", "补全歇后语：{r}——", "{r}——下一句是什么？",
                      "“{r}”，这个歇后语怎么接？"]


def clean_definition(defn: str) -> str:
    """A dictionary definition, with a lone "1." sense number removed ("1.撤回军队。" -> "撤回军队。")."""
    defn = clean_line(defn)
    if defn.startswith("1.") and not re.search(r"\s2\.|[。；;]2\.", defn):
        defn = defn[2:].strip()
    return defn


def definition_pairs(dictionary: list[tuple[str, str]]) -> dict[str, list[tuple[str, str]]]:
    """word -> [(prompt, response)]: words of 2+ CJK characters whose definition is a real one of a usable length
    (cross references such as "见…" are dropped). One pair per word; the template is fixed by the word's hash."""
    out: dict[str, list[tuple[str, str]]] = {}
    for word, defn in dictionary:
        defn = clean_definition(defn)
        if not re.fullmatch(r"[\u4e00-\u9fff]{2,}", word) or word in out:
            continue
        if not 4 <= len(defn) <= MAX_RESPONSE_CHARS or defn.startswith("见") or "\ufffd" in defn:
            continue
        out[word] = [(pick(DEFINITION_TEMPLATES, word, "def-template").format(w=word), defn)]
    return out


def xiehouyu_pairs(riddles: list[tuple[str, str]]) -> dict[str, list[tuple[str, str]]]:
    """riddle -> [(prompt, response)]; a riddle with several answers gets them joined by "；"."""
    answers: dict[str, list[str]] = {}
    for riddle, answer in riddles:
        answers.setdefault(clean_line(riddle), [])
        if clean_line(answer) not in answers[clean_line(riddle)]:
            answers[clean_line(riddle)].append(clean_line(answer))
    out = {}
    for riddle, ans in answers.items():
        response = "；".join(ans)
        template = pick(XIEHOUYU_TEMPLATES, riddle, "xhy-template")
        if template.startswith("{r}——"):
            response = f"{riddle}——{response}"
        if len(response) <= MAX_RESPONSE_CHARS:
            out[riddle] = [(template.format(r=riddle), response)]
    return out


def chat_pairs(conversations: list[list[str]]) -> dict[str, list[tuple[str, str]]]:
    """question -> [(question, reply), ...]: every turn and the turn that follows it, deduplicated."""
    out: dict[str, list[tuple[str, str]]] = {}
    for conv in conversations:
        for q, a in zip(conv, conv[1:]):
            if len(a) <= MAX_RESPONSE_CHARS and (q, a) not in out.get(q, []):
                out.setdefault(q, []).append((q, a))
    return out


def split_sft(families: dict[str, dict[str, list[tuple[str, str]]]]) -> dict[str, list[dict]]:
    """Cap each family (units chosen by hash), split units (word, riddle, question, review) by hash so that all
    pairs of a unit land in one split, drop repeated pairs, and order each split by hash."""
    out = {"train": [], "val": []}
    seen = set()
    for family, units in families.items():
        chosen = hash_sorted(list(units), f"cap:{family}")[: SFT_CAPS[family]]
        for unit in chosen:
            name = assign_split(f"{family}:{unit}", "sft", [("val", SFT_VAL)], "train")
            for prompt, response in units[unit]:
                if prompt and response and (prompt, response) not in seen:
                    seen.add((prompt, response))
                    out[name].append({"prompt": prompt, "response": response})
    return {k: hash_sorted(v, "sft:order", key=lambda r: r["prompt"] + "\x00" + r["response"])
            for k, v in out.items()}
