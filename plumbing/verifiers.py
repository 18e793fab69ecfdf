"""Rewards a program checks: the answer parsers and checkers of the verifiable tasks (data/prepare.py writes them).

Reinforcement learning from verifiable rewards (RLVR; DeepSeek-R1, Guo et al. 2025; Tülu 3, Lambert et al. 2024):
instead of a reward model's opinion, a program decides whether an answer is right, and the reward is 1 or 0. What
such a reward teaches can be measured exactly, on problems the model never saw.

The tasks' answers are written in one canonical form, and a checker is strict: the answer must be the whole
response up to ``[SEP]`` (nothing before it, nothing after it, not a character more or less), in that form.

* ``FAMILIES``: the task families and the checker of each:
  - ``arithmetic``: the sum or difference of two numbers of 2-3 digits, written digit by digit in Chinese
    numerals (``〇一二三四五六七八九``: 347 is ``三四七``, one token per digit, where the Arabic ``347`` would be
    one token and ``632`` two, ``63`` + ``##2``); ``parse_number`` reads the canonical form only (no sign, no
    leading ``〇``, no ``零``, no Arabic or full-width digits);
  - ``reverse``: a short string of Chinese characters written backwards (each character is one token).
* ``check(family, response, answer)``: the strict checker by family; ``contains`` is the deliberately lax one (the
  answer appears anywhere in the response), kept to show what a lax verifier invites (tests/test_verifiers.py).
* ``VERIFIERS``: the verifiers a stage takes by name (``--verifier``): ``exact`` (strict) and ``contains`` (lax).

What a checker cannot tell: how the answer was found. A model that writes the right digits for a wrong reason is
rewarded like one that adds; only accuracy on held-out problems, never seen in any form, says whether it learnt.
"""

from __future__ import annotations

CHINESE_DIGITS = "〇一二三四五六七八九"
FAMILIES = ("arithmetic", "reverse")


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


CHECKERS = {"arithmetic": check_arithmetic, "reverse": check_reverse}


def check(family: str, response: str, answer: str) -> bool:
    """The strict checker of ``family`` (``CHECKERS``). Raises ``KeyError`` for an unknown family."""
    return CHECKERS[family](response, answer)


def contains(family: str, response: str, answer: str) -> bool:
    """A deliberately lax checker: right whenever the answer appears anywhere in the response. A policy can farm it
    by writing many candidates in one answer; it exists to show that (tests/test_verifiers.py), never to train on."""
    return answer in response


VERIFIERS = {"exact": check, "contains": contains}
