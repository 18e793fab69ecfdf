"""Rewards a program checks: the answer parsers and checkers of the verifiable tasks (data/prepare.py writes them).

Reinforcement learning from verifiable rewards (RLVR; DeepSeek-R1, Guo et al. 2025; Tülu 3, Lambert et al. 2024):
instead of a reward model's opinion, a program decides whether an answer is right, and the reward is 1 or 0. What
such a reward teaches can be measured exactly, on problems the model never saw.

The tasks' answers are written in one canonical form, and a checker is strict: the answer must be the whole
response up to ``[SEP]`` (nothing before it, nothing after it, not a character more or less), in that form. An
instruction has no one answer: its checker wants the whole response to keep the instruction and look like a review.

* ``FAMILIES``: the task families and the checker of each:
  - ``arithmetic``: the sum or difference of two numbers of 2-3 digits, written digit by digit in Chinese
    numerals (``〇一二三四五六七八九``: 347 is ``三四七``, one token per digit, where the Arabic ``347`` would be
    one token and ``632`` two, ``63`` + ``##2``); ``parse_number`` reads the canonical form only (no sign, no
    leading ``〇``, no ``零``, no Arabic or full-width digits);
  - ``reverse``: a short string of Chinese characters written backwards (each character is one token);
  - ``instruction``: a review that keeps a verifiable instruction (IFEval, Zhou et al. 2023; Tülu 3's RLVR), its
    ``answer`` the instruction in a canonical form, ``KIND:ARGUMENT``: ``max_chars:20`` (at most 20 characters,
    punctuation included), ``min_chars:30`` (at least 30), ``mention:早餐`` (the review uses the word),
    ``begin:房间很`` (it starts with the phrase); data/prepare.py writes the first (data/prep/instructions.py).
    ``check_instruction`` also wants a real review, so that no degenerate answer passes: 8-120 characters, at least
    ``MIN_OTHER_CHARS`` different Chinese characters besides the argument, and at least half of its character
    pairs different (distinct-2 >= 0.5): the word alone, the word repeated, or a loop of a phrase fail; an answer
    that never ends gets 0 from every verifier; and an answer that copies the problem's prompt (``echoes``: half
    of the prompt's characters in order, or an answer made mostly of them) gets 0 too, for "写一条不超过二十个字的
    好评。" keeps its own limit and would otherwise pass for a review;
  - ``sentiment``: whether a quoted review is 正面 (positive) or 负面 (negative), the review corpus's label (Pang
    et al. 2002's polarity task); the answer is the two characters alone, so "正面负面" or "正面。" are wrong, and
    the held-out problems are half of each, so answering always one of them scores 50%.
* ``check(family, response, answer, prompt)``: the strict checker by family; ``contains`` is the deliberately lax
  one (the answer appears anywhere in the response), kept to show what a lax verifier invites
  (tests/test_verifiers.py).
* ``VERIFIERS``: the verifiers a stage takes by name (``--verifier``): ``exact`` (strict) and ``contains`` (lax).

What a checker cannot tell: how the answer was found. A model that writes the right digits for a wrong reason is
rewarded like one that adds; only accuracy on held-out problems, never seen in any form, says whether it learnt.
"""

from __future__ import annotations

import re

CHINESE_DIGITS = "〇一二三四五六七八九"
FAMILIES = ("arithmetic", "reverse", "instruction", "sentiment")
SENTIMENTS = ("正面", "负面")
INSTRUCTION_KINDS = ("max_chars", "min_chars", "mention", "begin")
ANSWER_CHARS = (8, 120)  # a constrained review's length in characters: the review corpus's own bounds
MIN_OTHER_CHARS = 4  # different Chinese characters a review must hold besides the instruction's argument
MIN_DISTINCT_PAIRS = 0.5  # the share of a review's adjacent character pairs that must be different (distinct-2)
ECHO_SHARE = 0.5  # an answer that shares this much of the prompt's characters in order copies it (``echoes``)


def to_chinese_digits(n: int) -> str:
    """A non-negative integer digit by digit in Chinese numerals: 632 -> "六三二", 0 -> "〇", 105 -> "一〇五"."""
    if n < 0:
        raise ValueError(f"the tasks' numbers are not negative, got {n}")
    return "".join(CHINESE_DIGITS[int(d)] for d in str(n))


def parse_number(text: str) -> int | None:
    """The integer written in ``text`` in the canonical form of ``to_chinese_digits``, or None if ``text`` is not
    exactly that: every character one of ``〇一…九``, and no leading ``〇`` unless the number is 0. Arabic digits,
    full-width digits, ``零``, signs, spaces and any other character make it None."""
    if not text or any(ch not in CHINESE_DIGITS for ch in text) or (text[0] == "〇" and len(text) > 1):
        return None
    return int("".join(str(CHINESE_DIGITS.index(ch)) for ch in text))


def check_arithmetic(response: str, answer: str) -> bool:
    """Right when ``response`` is the canonical number ``answer`` names, character for character."""
    value = parse_number(response)
    return value is not None and value == parse_number(answer)


def check_reverse(response: str, answer: str) -> bool:
    """Right when ``response`` is exactly the reversed string ``answer``."""
    return response == answer


def check_sentiment(response: str, answer: str) -> bool:
    """Right when ``response`` is exactly the label ``answer``, 正面 or 负面 (``SENTIMENTS``)."""
    return response == answer and answer in SENTIMENTS


def looks_like_a_review(response: str, argument: str = "") -> bool:
    """The guard every instruction shares: ``ANSWER_CHARS`` characters long, at least ``MIN_OTHER_CHARS`` different
    Chinese characters once every ``argument`` is taken out, and ``MIN_DISTINCT_PAIRS`` of its adjacent character
    pairs different. "早餐", "早餐早餐早餐早餐" and "早餐很好早餐很好早餐很好" fail; "早餐不错，服务也好。" passes."""
    low, high = ANSWER_CHARS
    if not low <= len(response) <= high:
        return False
    others = {ch for ch in (response.replace(argument, "") if argument else response) if "\u4e00" <= ch <= "\u9fff"}
    pairs = [response[i:i + 2] for i in range(len(response) - 1)]
    return len(others) >= MIN_OTHER_CHARS and len(set(pairs)) >= MIN_DISTINCT_PAIRS * len(pairs)


def parse_instruction(answer: str) -> tuple[str, str]:
    """``(kind, argument)`` of an instruction's canonical form ``KIND:ARGUMENT``. Raises ``ValueError`` for an unknown
    kind or an empty argument."""
    kind, _, argument = answer.partition(":")
    if kind not in INSTRUCTION_KINDS or not argument or (kind.endswith("_chars") and not argument.isdigit()):
        kinds = ", ".join(k + ":…" for k in INSTRUCTION_KINDS)
        raise ValueError(f"not an instruction: {answer!r}; expected one of {kinds}")
    return kind, argument


def keeps(response: str, kind: str, argument: str) -> bool:
    """Whether ``response`` keeps the instruction alone, with no guard: ``max_chars:N`` / ``min_chars:N`` is at most /
    at least N characters long; ``mention:W`` holds W; ``begin:P`` starts with P."""
    if kind.endswith("_chars"):
        return len(response) <= int(argument) if kind == "max_chars" else len(response) >= int(argument)
    return response.startswith(argument) if kind == "begin" else argument in response


def text_form(text: str) -> str:
    """The characters an echo is counted in: lower-case letters, digits and CJK, without whitespace or punctuation
    (the form of ``data/prep/splits.near_dup_form``), so that "写一条好评。" and "写一条好评" are the same text."""
    return re.sub(r"[\W_]+", "", text).lower()


def common_in_order(a: str, b: str) -> int:
    """The length of the longest common subsequence of ``a`` and ``b``: the most characters they share in the same
    order, gaps allowed ("写一条好评" and "好的，写一条不错的好评" share 5). Dynamic programming, O(len(a) len(b))."""
    row = [0] * (len(b) + 1)
    for ch in a:
        diagonal = 0  # row[j - 1] of the previous character of a
        for j, other in enumerate(b, 1):
            diagonal, row[j] = row[j], diagonal + 1 if ch == other else max(row[j], row[j - 1])
    return row[-1]


def echoes(response: str, prompt: str) -> bool:
    """Whether ``response`` copies ``prompt`` rather than answering it: the characters they share in order
    (``common_in_order`` of their ``text_form``) are at least ``ECHO_SHARE`` of the prompt's, or more than
    ``ECHO_SHARE`` of the response's.

    Why in order and with gaps: the echo comes back with words put around it or left out ("好的，写一条不超过二十个字
    的好评。", "不超过二十个字的好评"), and a length limit is kept by an echo as well as by a review. Why a share
    and not any shared word: a real review shares a few characters with its instruction ("一条", "好评", "的"),
    never half of them in order. The first rule catches the instruction inside an answer, the second an answer made
    mostly of the instruction's words."""
    shared, prompt_chars, response_chars = (common_in_order(text_form(response), text_form(prompt)),
                                            len(text_form(prompt)), len(text_form(response)))
    return shared > 0 and (shared >= ECHO_SHARE * prompt_chars or shared > ECHO_SHARE * response_chars)


def check_instruction(response: str, answer: str, prompt: str = "") -> bool:
    """Right when ``response`` keeps the instruction ``answer`` (``keeps``), looks like a review
    (``looks_like_a_review``, with a word or phrase to write taken out first) and does not copy the problem's
    ``prompt`` (``echoes``)."""
    kind, argument = parse_instruction(answer)
    written = "" if kind.endswith("_chars") else argument  # a word or phrase the answer must hold is not its own
    return keeps(response, kind, argument) and looks_like_a_review(response, written) and not echoes(response, prompt)


CHECKERS = {"arithmetic": check_arithmetic, "reverse": check_reverse, "instruction": check_instruction,
            "sentiment": check_sentiment}


def check(family: str, response: str, answer: str, prompt: str = "") -> bool:
    """The strict checker of ``family`` (``CHECKERS``) on ``response`` to a problem whose canonical answer is
    ``answer``; ``prompt``, the problem's text, is what an instruction's answer must not copy (``echoes``; the other
    families' answers are compared whole with their answer, which no prompt holds). Raises ``KeyError`` for an
    unknown family."""
    if family == "instruction":
        return check_instruction(response, answer, prompt)
    return CHECKERS[family](response, answer)


def contains(family: str, response: str, answer: str, prompt: str = "") -> bool:
    """A deliberately lax checker: right whenever the answer appears anywhere in the response (for an instruction,
    whenever the instruction's kind alone holds, with no guard against a degenerate answer). A policy can farm it by
    writing many candidates in one answer; it exists to show that (tests/test_verifiers.py), never to train on."""
    if family == "instruction":
        return keeps(response, *parse_instruction(answer))
    return answer in response


VERIFIERS = {"exact": check, "contains": contains}
