"""The notes in notes/ quote the code, every quote must still be the code, and every cross-reference must lead
somewhere.

A quote is a marker line naming a file and a symbol of it, followed by a ```python block:

    <!-- code: 3-PPO.py::gae -->
    ```python
    def gae(rewards, values, mask, gamma: float, lam: float):
        ...
    ```

The SYMBOL after ``::`` is one of
- a dotted path of def/class names: ``gae``, ``MultiHeadAttention.forward``, ``main.save`` (a function in ``main``);
- a name assigned at module or class level: ``DEFAULTS``, ``PRESETS``, ``GPTConfig.vocab_size``;
- ``A..B``: the consecutive statements from the start of A to the end of B, e.g. ``DEFAULTS..SAMPLE_PROMPT``;
- ``<imports>``: the lines from the file's first top-level import to its last;
- ``<module>``: the whole file, for any other statement that binds no name (``if __name__ == "__main__":``).
A def's, class's or assignment's source starts at its decorators and the comment lines directly above it.

The ```python block must be a contiguous run of lines of the symbol's current source, whitespace exact: the whole
symbol or an excerpt of it. The test fails when the symbol is gone or the quoted code is no longer inside it, naming
the first line that differs; it passes when the code only moved within the file. After editing code run
``python tests/test_notes.py --fix``: a quote whose code moved to another symbol or file, and is found verbatim in
exactly one place, gets the anchor of the smallest symbol there; quotes whose code changed are listed, to rewrite by
hand. Every ```python block needs a marker, and markers of the old line-range form (``<!-- code: FILE 120-134 -->``)
are errors. Every code file has its note (``notes/<file stem>.md``) naming the file in its first lines.

Cross-references are checked too. "第 10.3 节" (also "第 10、11 节", "第 4–6 节", "§3") must match a numbered heading
("## 10. ...", "### 10.3 ...") of the note it is written in, or of the note named right before it
("`gpt_model.md` 第 10.3 节") or right before the parenthesis it sits in ("`gpt_model.md`（至少第 10、11 节）").
A Markdown link to a note, ``[GPTModel](gpt_model.md#10-gptmodel整机-)``, must name an existing note and, after ``#``,
the GitHub anchor of one of its headings (lower-cased, punctuation dropped, spaces turned into ``-``, CJK kept).
"""

import ast
import functools
import posixpath
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTES = ROOT / "notes"
MARKER = re.compile(r"<!-- code: (\S+?)::(\S+) -->")
OLD_MARKER = re.compile(r"<!-- code: (\S+) (\d+)-(\d+) -->")
NUMBERS = r"\d+(?:\.\d+)*(?:[、–-]\d+(?:\.\d+)*)*"
SECTION_REF = re.compile(rf"(?:`([\w.-]+\.md)` ?)?(?:第 ?({NUMBERS}) ?节|§ ?({NUMBERS}))")
NOTE_PAREN = re.compile(r"`([\w.-]+\.md)`（[^（）]*）")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def code_files():
    """The files a note explains: the root's scripts, the package's modules, data/prepare.py and its package's."""
    package = [p for p in sorted((ROOT / "plumbing").glob("*.py")) if p.name != "__init__.py"]
    data = [p for p in sorted((ROOT / "data" / "prep").glob("*.py")) if p.name != "__init__.py"]
    return sorted(ROOT.glob("*.py")) + package + [ROOT / "data" / "prepare.py"] + data


# --- symbols of a code file ----------------------------------------------------------------------------------------

@functools.cache
def symbols(text):
    """Every symbol of a module's source: name -> (first line, last line), 1-based and inclusive."""
    lines = text.split("\n")
    tree = ast.parse(text)
    found = {}

    def start_of(node):
        first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        while first > 1 and lines[first - 2].strip().startswith("#"):
            first -= 1
        return first

    def visit(parent, prefix, names_too):
        for node in ast.iter_child_nodes(parent):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                found.setdefault(prefix + node.name, (start_of(node), node.end_lineno))
                visit(node, prefix + node.name + ".", isinstance(node, ast.ClassDef))
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names = [t for t in targets if isinstance(t, ast.Name)]
                names += [e for t in targets if isinstance(t, ast.Tuple) for e in t.elts if isinstance(e, ast.Name)]
                for name in names if names_too else []:
                    found.setdefault(prefix + name.id, (start_of(node), node.end_lineno))
            else:
                visit(node, prefix, False)  # a def inside an if/with/try/for block keeps its parent's prefix

    visit(tree, "", True)
    imports = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
    if imports:
        found["<imports>"] = (imports[0].lineno, imports[-1].end_lineno)
    found["<module>"] = (1, len(lines))
    return found


def symbol_lines(text, symbol):
    """(first, last) lines of ``symbol`` (a name, ``A..B`` or a ``<pseudo-symbol>``) in ``text``, or None."""
    table = symbols(text)
    if ".." in symbol:
        a, b = symbol.split("..", 1)
        if a in table and b in table and table[a][0] <= table[b][1]:
            return table[a][0], table[b][1]
        return None
    return table.get(symbol)


def anchor_for(text, first, last):
    """The smallest symbol whose source holds lines first..last; else a span ``A..B`` of top-level symbols."""
    table = symbols(text)
    inside = [name for name, (a, b) in table.items() if a <= first and last <= b and name != "<module>"]
    if inside:
        return min(inside, key=lambda name: table[name][1] - table[name][0])
    top = {name: span for name, span in table.items() if "." not in name and not name.startswith("<")}
    starts = [name for name in top if top[name][0] <= first]
    ends = [name for name in top if top[name][1] >= last]
    if starts and ends:
        a = max(starts, key=lambda name: top[name][0])
        b = min(ends, key=lambda name: top[name][1])
        if first <= top[a][1] and top[b][0] <= last:
            return f"{a}..{b}"
    return "<module>"


def find_run(lines, block):
    """0-based starts where ``block`` is a contiguous run of ``lines``."""
    n = len(block)
    return [s for s in range(len(lines) - n + 1) if lines[s:s + n] == block]


def closest_difference(source, block):
    """(i, k): block laid on source from source[i] has the most equal lines; block[k] is its first unequal line."""
    def equal(i):
        return sum(1 for k, line in enumerate(block) if i + k < len(source) and source[i + k] == line)
    i = max(range(len(source)), key=equal)
    k = next(k for k, line in enumerate(block) if i + k >= len(source) or source[i + k] != line)
    return i, k


def locate(block, files):
    """Every place (path, first line, last line) in ``files`` (path -> text) where ``block`` is found verbatim."""
    return [(path, s + 1, s + len(block)) for path, text in files.items()
            for s in find_run(text.removesuffix("\n").split("\n"), block)]


# --- quotes ----------------------------------------------------------------------------------------------------------

def quotes(note):
    """Each ```python block of a note's text: (line number of the fence, the line above it, its code lines)."""
    lines = note.split("\n")
    i = 0
    while i < len(lines):
        if lines[i].startswith("```"):
            end = next((j for j in range(i + 1, len(lines)) if lines[j] == "```"), len(lines))
            if lines[i] == "```python":
                yield i + 1, lines[i - 1].strip() if i > 0 else "", lines[i + 1:end]
            i = end
        i += 1


def check_quote(where, marker, block, files):
    """The problem of one quote as a readable line, or None."""
    old = OLD_MARKER.fullmatch(marker)
    if old:
        return (f"{where}: old line-range marker {marker}; anchor it to a symbol: "
                f"<!-- code: {old.group(1)}::SYMBOL -->")
    m = MARKER.fullmatch(marker)
    if m is None:
        return f"{where}: ```python block with no '<!-- code: FILE::SYMBOL -->' marker above it"
    path, symbol = m.groups()
    where += f" [{path}::{symbol}]"
    if path not in files:
        return f"{where}: no code file {path}"
    if not block:
        return f"{where}: the quote is empty"
    span = symbol_lines(files[path], symbol)
    if span is None:
        return f"{where}: {path} has no symbol {symbol}"
    first, last = span
    source = files[path].removesuffix("\n").split("\n")[first - 1:last]
    if find_run(source, block):
        return None
    places = locate(block, files)
    if len(places) == 1:
        path2, a, b = places[0]
        return (f"{where}: the quoted code moved to {path2}::{anchor_for(files[path2], a, b)} "
                f"(run: python tests/test_notes.py --fix)")
    i, k = closest_difference(source, block)
    in_code = repr(source[i + k]) if i + k < len(source) else f"(past the end of {symbol})"
    return (f"{where}: line {first + i + k} of {path} is {in_code} but the note has {block[k]!r}; "
            f"update the note to the code")


def check_note(name, note, files):
    """Problems of one note's quotes as readable lines; ``files`` maps each code file's path to its text."""
    lines = note.split("\n")
    problems = [f"{name}:{i + 1}: marker not followed by a ```python block" for i, line in enumerate(lines)
                if line.strip().startswith("<!-- code:") and (i + 1 == len(lines) or lines[i + 1] != "```python")]
    for line_no, marker, block in quotes(note):
        problem = check_quote(f"{name}:{line_no}", marker, block, files)
        if problem:
            problems.append(problem)
    return problems


def fix_note(note, files):
    """The note with every quote that is not in its symbol, but verbatim in exactly one place, re-anchored there."""
    lines = note.split("\n")
    for line_no, marker, block in list(quotes(note)):
        if MARKER.fullmatch(marker) and block and check_quote("", marker, block, files):
            places = locate(block, files)
            if len(places) == 1:
                path, first, last = places[0]
                lines[line_no - 2] = f"<!-- code: {path}::{anchor_for(files[path], first, last)} -->"
    return "\n".join(lines)


# --- cross-references ----------------------------------------------------------------------------------------------

def prose(note):
    """(line number, line) of each line of a note outside ``` fences."""
    inside = False
    for i, line in enumerate(note.split("\n")):
        if line.startswith("```"):
            inside = not inside
        elif not inside:
            yield i + 1, line


def slug(heading):
    """GitHub's anchor for a heading's text: lower case, punctuation dropped, each space -> '-', CJK kept.

    Nothing is trimmed after the punctuation goes: '2. 小结 ★' gives '2-小结-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def headings(note):
    """(section numbers, anchors) of a note's headings: '### 10.3 `forward`' gives '10.3' and '103-forward'."""
    numbers, anchors, seen = set(), set(), {}
    for _, line in prose(note):
        m = re.match(r"#{1,6} (.+)", line)
        if m:
            number = re.match(r"(\d+(?:\.\d+)*)\.? ", m.group(1))
            if number:
                numbers.add(number.group(1))
            anchor = slug(m.group(1))
            anchors.add(f"{anchor}-{seen[anchor]}" if anchor in seen else anchor)
            seen[anchor] = seen.get(anchor, 0) + 1
    return numbers, anchors


def check_refs(name, note, docs):
    """Problems of one note's cross-references; ``docs`` maps each Markdown file's path to its text."""
    problems = []
    for line_no, line in prose(note):
        named_by_paren = [(m.start(), m.end(), m.group(1)) for m in NOTE_PAREN.finditer(line)]
        for m in SECTION_REF.finditer(line):
            target = m.group(1) or next((n for a, b, n in named_by_paren if a < m.start() < b), None)
            path = posixpath.join(posixpath.dirname(name), target) if target else name
            if path not in docs:
                problems.append(f"{name}:{line_no}: '{m.group(0)}' names {target}, which is not a note")
                continue
            numbers = headings(docs[path])[0]
            for number in re.split(r"[、–-]", m.group(2) or m.group(3)):
                if number not in numbers:
                    problems.append(f"{name}:{line_no}: '{m.group(0)}' points at section {number} of "
                                    f"{posixpath.basename(path)}, which has no heading numbered {number}")
        for m in LINK.finditer(re.sub(r"`[^`]*`", "", line)):
            file, _, anchor = m.group(1).partition("#")
            if "://" in file or not (file.endswith(".md") or (not file and anchor)):
                continue
            path = posixpath.normpath(posixpath.join(posixpath.dirname(name), file)) if file else name
            if path not in docs:
                problems.append(f"{name}:{line_no}: link '{m.group(1)}' leads to {file}, which does not exist")
            elif anchor and anchor not in headings(docs[path])[1]:
                problems.append(f"{name}:{line_no}: link '{m.group(1)}': {posixpath.basename(path)} has no "
                                f"heading with the anchor #{anchor}")
    return problems


# --- the project's notes -------------------------------------------------------------------------------------------

def read_all(paths):
    return {p.relative_to(ROOT).as_posix(): p.read_text(encoding="utf-8") for p in paths}


NOTE_FILES = sorted(NOTES.glob("*.md"))
CODE = read_all(code_files())
DOCS = read_all(NOTE_FILES + sorted(ROOT.glob("*.md")))


@pytest.mark.parametrize("note", NOTE_FILES, ids=[p.name for p in NOTE_FILES])
def test_note_quotes_match_the_code(note):
    problems = check_note(f"notes/{note.name}", note.read_text(encoding="utf-8"), CODE)
    assert not problems, "notes out of date with the code:\n" + "\n".join(problems)


@pytest.mark.parametrize("note", NOTE_FILES, ids=[p.name for p in NOTE_FILES])
def test_note_cross_references_lead_somewhere(note):
    problems = check_refs(f"notes/{note.name}", note.read_text(encoding="utf-8"), DOCS)
    assert not problems, "cross-references to nothing:\n" + "\n".join(problems)


def test_every_code_file_has_a_note():
    missing = [str(f.relative_to(ROOT)) for f in code_files() if not (NOTES / f"{f.stem}.md").is_file()]
    assert not missing, f"code files with no note in notes/: {missing}"


def test_each_note_names_its_file_at_the_top():
    for f in code_files():
        note = NOTES / f"{f.stem}.md"
        if note.is_file():
            head = "\n".join(note.read_text(encoding="utf-8").split("\n")[:5])
            assert str(f.relative_to(ROOT)) in head, f"{note.name} should name {f.relative_to(ROOT)} at its top"


# --- the checker itself, on small made-up code and notes --------------------------------------------------------

SRC = "import os\n\n\n# adds one\ndef f(x):\n    y = x + 1\n    return y\n\n\nLIMIT = 3\n"
QUOTE_F = "# adds one\ndef f(x):\n    y = x + 1\n    return y\n"


def note_quoting(anchor, code):
    return f"# m\n\n<!-- code: {anchor} -->\n```python\n{code}```\n"


def test_checker_accepts_a_faithful_whole_symbol_quote():
    assert check_note("n.md", note_quoting("m.py::f", QUOTE_F), {"m.py": SRC}) == []
    assert check_note("n.md", note_quoting("m.py::f", QUOTE_F), {"m.py": SRC.replace("+ 1", "+ 2")}) != []


def test_checker_accepts_an_excerpt_but_not_code_outside_the_symbol():
    assert check_note("n.md", note_quoting("m.py::f", "    y = x + 1\n"), {"m.py": SRC}) == []
    assert check_note("n.md", note_quoting("m.py::f", "LIMIT = 3\n"), {"m.py": SRC}) != []


def test_checker_accepts_code_that_moved_within_the_file():
    moved = SRC.replace("import os\n", "import os\nimport re\n\n\ndef g():\n    pass\n")
    assert symbol_lines(moved, "f") != symbol_lines(SRC, "f")
    assert check_note("n.md", note_quoting("m.py::f", QUOTE_F), {"m.py": moved}) == []


def test_checker_reports_an_edited_line():
    problems = check_note("n.md", note_quoting("m.py::f", QUOTE_F), {"m.py": SRC.replace("x + 1", "x + 2")})
    assert len(problems) == 1
    assert "n.md:4 [m.py::f]" in problems[0] and "line 6 of m.py" in problems[0]
    assert "'    y = x + 2'" in problems[0] and "'    y = x + 1'" in problems[0]


def test_checker_reports_a_missing_symbol():
    problems = check_note("n.md", note_quoting("m.py::h", QUOTE_F), {"m.py": SRC})
    assert problems == ["n.md:4 [m.py::h]: m.py has no symbol h"]
    assert check_note("n.md", note_quoting("m.py::f..NOPE", QUOTE_F), {"m.py": SRC}) != []


def test_fix_reanchors_a_quote_moved_into_another_function():
    moved = SRC.replace("def f(x):\n    y = x + 1",
                        "def f(x):\n    return helper(x)\n\n\ndef helper(x):\n    y = x + 1")
    note = note_quoting("m.py::f", "    y = x + 1\n    return y\n")
    problems = check_note("n.md", note, {"m.py": moved})
    assert len(problems) == 1 and "moved to m.py::helper" in problems[0]
    fixed = fix_note(note, {"m.py": moved})
    assert "<!-- code: m.py::helper -->" in fixed
    assert check_note("n.md", fixed, {"m.py": moved}) == []


def test_fix_leaves_a_changed_quote_alone():
    note = note_quoting("m.py::f", QUOTE_F)
    assert fix_note(note, {"m.py": SRC.replace("x + 1", "x + 2")}) == note


def test_spans_imports_and_the_smallest_symbol():
    assert symbol_lines(SRC, "<imports>") == (1, 1)
    assert symbol_lines(SRC, "f") == (4, 7)  # the comment above the def belongs to it
    assert symbol_lines(SRC, "f..LIMIT") == (4, 10)
    assert symbol_lines(SRC, "LIMIT..f") is None
    nested = "class C:\n    N = 1\n\n    def m(self):\n        def inner():\n            return 2\n"
    assert anchor_for(nested, 5, 6) == "C.m.inner" and anchor_for(nested, 2, 2) == "C.N"
    assert anchor_for(SRC, 5, 10) == "f..LIMIT" and anchor_for(SRC, 1, 1) == "<imports>"
    quote = "    return y\n\n\nLIMIT = 3\n"
    assert check_note("n.md", note_quoting("m.py::f..LIMIT", quote), {"m.py": SRC}) == []


def test_checker_reports_an_old_line_range_marker():
    problems = check_note("n.md", note_quoting("m.py 4-7", QUOTE_F), {"m.py": SRC})
    assert len(problems) == 1 and "old line-range marker" in problems[0] and "m.py::SYMBOL" in problems[0]


def test_checker_reports_a_quote_without_marker_and_a_missing_file():
    bare = "text\n```python\nx = 1\n```\n"
    assert "no '<!-- code:" in check_note("n.md", bare, {})[0]
    assert "no code file m.py" in check_note("n.md", note_quoting("m.py::f", QUOTE_F), {})[0]
    assert "not followed by" in check_note("n.md", "<!-- code: m.py::f -->\ntext\n", {})[0]
    # other fences (shape diagrams, shell commands) need no marker
    assert check_note("n.md", "```text\n(B, T, E)\n```\n```bash\nmake test\n```\n", {}) == []


DOC_A = "# a\n\n## 1. First\n\n### 1.2 `forward` ★\n\n## 2. 小结：end\n"


def test_refs_to_a_missing_section_fail():
    docs = {"n/a.md": DOC_A, "n/b.md": "x"}
    assert check_refs("n/a.md", "见第 1.2 节和第 1、2 节\n", docs) == []
    assert check_refs("n/b.md", "见 `a.md` 第 2 节，`a.md`（尤其是第 1.2 节）\n", docs) == []
    problems = check_refs("n/a.md", "\n见第 3 节\n", docs)
    assert problems == ["n/a.md:2: '第 3 节' points at section 3 of a.md, which has no heading numbered 3"]
    assert len(check_refs("n/b.md", "`a.md` 第 1–4 节\n", docs)) == 1
    assert "b.md, which has no heading numbered 2" in check_refs("n/b.md", "§2\n", docs)[0]
    assert "not a note" in check_refs("n/b.md", "`c.md` 第 1 节\n", docs)[0]
    assert check_refs("n/a.md", "```python\n# 第 9 节\n```\n", docs) == []  # code is not prose


def test_links_to_a_missing_anchor_fail():
    docs = {"n/a.md": DOC_A, "n/b.md": "x"}
    good = "[f](a.md#12-forward-) [g](a.md#2-小结end) [a](a.md) [s](#1-first) [w](https://x.org/y.md#z)\n"
    assert check_refs("n/a.md", good, docs) == []
    problems = check_refs("n/b.md", "[f](a.md#3-forward)\n", docs)
    assert problems == ["n/b.md:1: link 'a.md#3-forward': a.md has no heading with the anchor #3-forward"]
    assert "does not exist" in check_refs("n/b.md", "[c](c.md)\n", docs)[0]


if __name__ == "__main__":
    if sys.argv[1:] == ["--fix"]:
        for note in NOTE_FILES:
            text = note.read_text(encoding="utf-8")
            fixed = fix_note(text, CODE)
            if fixed != text:
                note.write_text(fixed, encoding="utf-8")
                print(f"re-anchored quotes in notes/{note.name}")
    left = [p for note in NOTE_FILES
            for p in check_note(f"notes/{note.name}", note.read_text(encoding="utf-8"), CODE)
            + check_refs(f"notes/{note.name}", note.read_text(encoding="utf-8"), DOCS)]
    print("\n".join(left) or "all quotes match the code and all cross-references lead somewhere")
    sys.exit(1 if left else 0)
