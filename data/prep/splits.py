"""Deterministic splitting and near-duplicate removal: every split and order is decided by a hash of the text
(``unit_hash``), never by random state or input order, and near-duplicates (truncated or re-punctuated copies) are
grouped so that a whole group lands in one split."""

from __future__ import annotations

import hashlib
import re

# Near-duplicates (the review corpus holds many truncated copies of the same review): after normalisation, one text
# inside another (the shorter of at least NEAR_DUP_MIN characters), or the same first NEAR_DUP_PREFIX characters.
NEAR_DUP_MIN, NEAR_DUP_PREFIX = 6, 20


def unit_hash(text: str, salt: str) -> float:
    """A number in [0, 1) fixed by ``salt`` and ``text`` (first 8 bytes of sha256), used for every split and
    ordering decision so that outputs never depend on RNG state or input order."""
    digest = hashlib.sha256(f"{salt}\x00{text}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0 ** 64


def assign_split(text: str, salt: str, fractions: list[tuple[str, float]], default: str) -> str:
    """Name of the split ``text`` falls into: the first of ``fractions`` whose cumulative share covers its hash,
    else ``default``."""
    u, acc = unit_hash(text, salt), 0.0
    for name, frac in fractions:
        acc += frac
        if u < acc:
            return name
    return default


def hash_sorted(items, salt: str, key=lambda x: x):
    """``items`` in a fixed pseudo-random order given by ``unit_hash(key(item), salt)`` (ties by key)."""
    return sorted(items, key=lambda x: (unit_hash(key(x), salt), key(x)))


def pick(options: list[str], key: str, salt: str) -> str:
    """The option of ``options`` that ``unit_hash(key, salt)`` falls on: a template chosen by the text, not by
    chance."""
    return options[int(unit_hash(key, salt) * len(options))]


def dedupe(items):
    """Keep the first occurrence of each item, in order."""
    seen, out = set(), []
    for x in items:
        if x not in seen:
            seen.add(x)
            out.append(x)
    return out


def split_documents(docs: list[str], val_frac: float, salt: str = "pretrain") -> dict[str, list[str]]:
    """Deduplicate documents and split them by hash into ``train``/``val`` (each in hash order)."""
    out = {"train": [], "val": []}
    for d in dedupe(docs):
        out[assign_split(d, salt, [("val", val_frac)], "train")].append(d)
    return {k: hash_sorted(v, salt + ":order") for k, v in out.items()}


def near_dup_form(text: str) -> str:
    """The form near-duplicates are compared in: lower case, letters, digits and CJK only (no whitespace or
    punctuation), so that "收到后，包装完好。" and "收到后包装完好" are the same text."""
    return re.sub(r"[\W_]+", "", text).lower()


class NearDupIndex:
    """The texts of a collection, indexed to answer "which of them are near-duplicates of this one?".

    Two texts are near-duplicates when, in ``near_dup_form``, one contains the other (the shorter having at least
    ``NEAR_DUP_MIN`` characters) or both start with the same ``NEAR_DUP_PREFIX`` characters. Containment is found
    through an index of every ``NEAR_DUP_MIN``-character piece of the texts up to ``long`` characters (a query
    contained in a text holds that text's piece at its own start); longer texts (whole documents) are searched
    directly, and only for the query inside them.
    """

    def __init__(self, texts, long: int = 400):
        self.forms = [near_dup_form(t) for t in texts]
        self.pieces: dict[str, list[int]] = {}
        self.prefixes: dict[str, list[int]] = {}
        long_forms = []
        for i, f in enumerate(self.forms):
            if len(f) >= NEAR_DUP_PREFIX:
                self.prefixes.setdefault(f[:NEAR_DUP_PREFIX], []).append(i)
            if len(f) > long:
                long_forms.append(f)
            elif len(f) >= NEAR_DUP_MIN:
                for piece in {f[j:j + NEAR_DUP_MIN] for j in range(len(f) - NEAR_DUP_MIN + 1)}:
                    self.pieces.setdefault(piece, []).append(i)
        self.long_text = "\x00".join(long_forms)

    def matches(self, text: str) -> list[int]:
        """Indices of the short texts that are near-duplicates of ``text`` (a match inside a long text counts as
        -1)."""
        f = near_dup_form(text)
        found = set(self.prefixes.get(f[:NEAR_DUP_PREFIX], [])) if len(f) >= NEAR_DUP_PREFIX else set()
        if len(f) >= NEAR_DUP_MIN:
            found |= {i for i in self.pieces.get(f[:NEAR_DUP_MIN], []) if f in self.forms[i]}  # text inside them
            for j in range(len(f) - NEAR_DUP_MIN + 1):  # them inside text: each starts at some piece of text
                found |= {i for i in self.pieces.get(f[j:j + NEAR_DUP_MIN], [])
                          if len(self.forms[i]) <= len(f) and self.forms[i] in f}
            if f in self.long_text:
                found.add(-1)
        return sorted(found)


def near_duplicate_groups(texts: list[str]) -> dict[str, str]:
    """text -> the key of its near-duplicate group (the smallest member): texts joined by a chain of
    near-duplicate pairs share a key, so a split decided by the key keeps every copy of a review together."""
    index = NearDupIndex(texts)
    parent = list(range(len(texts)))

    def root(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i, t in enumerate(texts):
        for j in index.matches(t):
            if j >= 0:
                a, b = root(i), root(j)
                if a != b:
                    parent[max(a, b)] = min(a, b)
    members: dict[int, list[str]] = {}
    for i, t in enumerate(texts):
        members.setdefault(root(i), []).append(t)
    return {t: min(group) for group in members.values() for t in group}


def count_near_duplicates(queries: list[str], texts: list[str]) -> int:
    """How many of ``queries`` have a near-duplicate among ``texts`` (``NearDupIndex``)."""
    index = NearDupIndex(texts)
    return sum(bool(index.matches(q)) for q in queries)
