"""Verifiable tasks: problems with exact answers (sums and differences in Chinese-numeral digits, strings to
reverse), generated from a seed with no problem in two splits. No model, no network; the number format is
``plumbing/verifiers.py``'s, the one the checkers read."""

from __future__ import annotations

import itertools
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for plumbing/verifiers.py

from plumbing.verifiers import to_chinese_digits  # noqa: E402  (standard library only, like this package)

TASK_SEED = 20261203
# problems per family in the held-out splits: test is the report card's (>= 500 per family), val is for recipe sweeps
TASK_HELD_OUT = {"test": 500, "val": 200}
ARITHMETIC_RANGE = (10, 99)  # operands of 2 digits: 4095 unordered pairs, 700 held out, the rest for training
REVERSE_TRAIN = 6000  # strings to reverse for training
REVERSE_LENGTHS = (3, 4)  # characters to reverse
ARITHMETIC_TEMPLATES = ["计算：{a}{op}{b}", "{a}{op}{b}等于多少？", "{a}{op}{b}得几？"]
REVERSE_TEMPLATES = ["把“{s}”倒过来写。", "倒序写出：{s}", "“{s}”反过来是什么？"]
# 120 common characters for the strings to reverse: each is one token of the vocabulary
REVERSE_CHARS = ("天地人日月山水火木金土风云雨雪花草树林石田禾米竹羊牛马鸟鱼虫口手足目耳心头发"
                 "大小上下左右中前后里外东南西北春夏秋冬红黄蓝白黑青早晚年时分秒长短高低多少远近"
                 "开关来去出入生老病好坏新旧明暗冷热甜苦香书画笔纸门窗车船灯")


def arithmetic_rows(forms: list[tuple[int, str, int]], rng) -> list[dict]:
    """The problems of an operand pair: each (a, op, b) of ``forms`` in one of the templates, its answer the sum or
    difference digit by digit in Chinese numerals (``verifiers.to_chinese_digits``)."""
    rows = []
    for a, op, b in forms:
        value = a + b if op == "加" else a - b
        template = ARITHMETIC_TEMPLATES[rng.randrange(len(ARITHMETIC_TEMPLATES))]
        rows.append({"prompt": template.format(a=to_chinese_digits(a), op=op, b=to_chinese_digits(b)),
                     "answer": to_chinese_digits(value), "family": "arithmetic"})
    return rows


def arithmetic_tasks(seed: int) -> dict[str, list[dict]]:
    """Sums and differences of two 2-digit numbers (carries and borrows included), by unordered operand pair: every
    pair, shuffled, goes to one split, so no pair is in two. A held-out pair is one problem (a + b or the larger
    minus the smaller, in a random order); a training pair is all three (a + b, b + a and the difference), the
    most a pair can teach without giving a held-out pair away."""
    rng = random.Random(f"{seed}:arithmetic")
    low, high = ARITHMETIC_RANGE
    pairs = [(a, b) for a in range(low, high + 1) for b in range(a, high + 1)]
    rng.shuffle(pairs)
    out, start = {}, 0
    for split, count in TASK_HELD_OUT.items():
        out[split] = []
        for a, b in pairs[start:start + count]:
            x, y = (a, b) if rng.random() < 0.5 else (b, a)
            form = (x, "加", y) if rng.random() < 0.5 else (max(a, b), "减", min(a, b))
            out[split] += arithmetic_rows([form], rng)
        start += count
    out["train"] = [row for a, b in pairs[start:]
                    for row in arithmetic_rows([(a, "加", b), (b, "加", a), (b, "减", a)], rng)]
    return out


def pieces(text: str, shortest: int = REVERSE_LENGTHS[0]) -> set[str]:
    """Every run of at least ``shortest`` characters of ``text``: "天地人日" -> 天地人, 地人日, 天地人日."""
    return {text[i:j] for i in range(len(text)) for j in range(i + shortest, len(text) + 1)}


def reverse_tasks(seed: int) -> dict[str, list[dict]]:
    """Strings of 3-4 different characters to write backwards, drawn at random. A string and its reversal are one
    problem (each is the other's answer), as a + b and b + a are for the sums: a string drawn already, as itself or
    reversed, in any split, is drawn again, so no problem is in two splits either way round; so is a string inside
    one drawn already or holding one ("开月西" and "近开月西"), whose prompts would be near-duplicates
    (``splits.NearDupIndex``: one inside the other)."""
    rng, drawn, inside, out = random.Random(f"{seed}:reverse"), set(), set(), {}
    for split, count in {**TASK_HELD_OUT, "train": REVERSE_TRAIN}.items():
        out[split] = []
        while len(out[split]) < count:
            text = "".join(rng.sample(REVERSE_CHARS, rng.randint(*REVERSE_LENGTHS)))
            if text in inside or pieces(text) & drawn:
                continue
            drawn.update((text, text[::-1]))  # one entry for a palindrome
            inside.update(pieces(text) | pieces(text[::-1]))
            template = REVERSE_TEMPLATES[rng.randrange(len(REVERSE_TEMPLATES))]
            out[split].append({"prompt": template.format(s=text), "answer": text[::-1], "family": "reverse"})
    return out


def build_tasks(seed: int = TASK_SEED) -> dict[str, list[dict]]:
    """The verifiable tasks, ``{split: [{"prompt", "answer", "family"}]}`` for test, val and train: each family's
    problems generated from ``seed`` with no problem in two splits, the families interleaved (a training split's
    order is then shuffled by the stages' own data order)."""
    families = [arithmetic_tasks(seed), reverse_tasks(seed)]
    out = {}
    for split in ("test", "val", "train"):
        rows = itertools.zip_longest(*(family[split] for family in families))
        out[split] = [row for group in rows for row in group if row is not None]
    return out
