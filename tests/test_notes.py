"""The notes in notes/ quote the code, and every quote must still be the code.

A quote is a marker line naming a file and a line range, followed by a ```python block holding exactly those
lines:

    <!-- code: gpt_model.py 120-134 -->
    ```python
    ...lines 120-134 of gpt_model.py...
    ```

Every ```python block in a note must have such a marker, and every code file must have its note
(``notes/<file stem>.md``). After editing code, run ``python tests/test_notes.py --fix``: quotes whose lines only
moved are found again by their content and renumbered; quotes whose content changed are listed, to rewrite by hand.
"""

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTES = ROOT / "notes"
MARKER = re.compile(r"<!-- code: (\S+) (\d+)-(\d+) -->")


def code_files():
    return sorted(ROOT.glob("*.py")) + [ROOT / "data" / "prepare.py"]


def quotes(note):
    """Each ```python block of a note's text: (line number of the fence, marker match or None, code lines)."""
    lines = note.split("\n")
    i = 0
    while i < len(lines):
        if lines[i].startswith("```"):
            end = next((j for j in range(i + 1, len(lines)) if lines[j] == "```"), len(lines))
            if lines[i] == "```python":
                marker = MARKER.fullmatch(lines[i - 1].strip()) if i > 0 else None
                yield i + 1, marker, lines[i + 1:end]
            i = end
        i += 1


def find_block(code_lines, block, near):
    """1-based start of ``block`` inside ``code_lines`` closest to line ``near``, or None."""
    n = len(block)
    starts = [s for s in range(len(code_lines) - n + 1) if code_lines[s:s + n] == block]
    return min(starts, key=lambda s: abs(s + 1 - near)) + 1 if starts else None


def check_note(name, note, read):
    """Problems of one note as readable lines; ``read(path)`` returns a code file's text or None if missing."""
    lines = note.split("\n")
    problems = [f"{name}:{i + 1}: marker not followed by a ```python block" for i, line in enumerate(lines)
                if MARKER.fullmatch(line.strip()) and (i + 1 == len(lines) or lines[i + 1] != "```python")]
    for line_no, marker, block in quotes(note):
        where = f"{name}:{line_no}"
        if marker is None:
            problems.append(f"{where}: ```python block with no '<!-- code: FILE FIRST-LAST -->' marker above it")
            continue
        path, first, last = marker.group(1), int(marker.group(2)), int(marker.group(3))
        where += f" [{path} {first}-{last}]"
        text = read(path)
        if text is None:
            problems.append(f"{where}: no file {path}")
            continue
        code = text.removesuffix("\n").split("\n")
        cited = code[first - 1:last] if 1 <= first <= last else []
        if cited == block:
            continue
        moved = find_block(code, block, first)
        if moved is not None:
            problems.append(f"{where}: the quoted code moved to lines {moved}-{moved + len(block) - 1} "
                            f"(run: python tests/test_notes.py --fix)")
            continue
        k = next((k for k in range(max(len(cited), len(block))) if k >= len(cited) or k >= len(block)
                  or cited[k] != block[k]), 0)
        in_code = repr(cited[k]) if k < len(cited) else "(past the range)"
        in_note = repr(block[k]) if k < len(block) else "(the quote ended)"
        problems.append(f"{where}: line {first + k} of {path} is {in_code} but the note has {in_note}; "
                        f"update the note to the code")
    return problems


def fix_note(note, read):
    """The note with every marker whose code only moved renumbered to where the code now is."""
    lines = note.split("\n")
    for line_no, marker, block in list(quotes(note)):
        if marker is None or read(marker.group(1)) is None:
            continue
        code = read(marker.group(1)).removesuffix("\n").split("\n")
        start = find_block(code, block, int(marker.group(2)))
        if start is not None:
            lines[line_no - 2] = f"<!-- code: {marker.group(1)} {start}-{start + len(block) - 1} -->"
    return "\n".join(lines)


def read_project_file(path):
    p = ROOT / path
    return p.read_text(encoding="utf-8") if p.is_file() else None


NOTE_FILES = sorted(NOTES.glob("*.md"))


@pytest.mark.parametrize("note", NOTE_FILES, ids=[p.name for p in NOTE_FILES])
def test_note_quotes_match_the_code(note):
    problems = check_note(f"notes/{note.name}", note.read_text(encoding="utf-8"), read_project_file)
    assert not problems, "notes out of date with the code:\n" + "\n".join(problems)


def test_every_code_file_has_a_note():
    missing = [str(f.relative_to(ROOT)) for f in code_files() if not (NOTES / f"{f.stem}.md").is_file()]
    assert not missing, f"code files with no note in notes/: {missing}"


def test_each_note_names_its_file_at_the_top():
    for f in code_files():
        note = NOTES / f"{f.stem}.md"
        if note.is_file():
            head = "\n".join(note.read_text(encoding="utf-8").split("\n")[:5])
            assert str(f.relative_to(ROOT)) in head, f"{note.name} should name {f.relative_to(ROOT)} at its top"


CODE = "def f(x):\n    y = x + 1\n    return y\n"
NOTE = "# f\n\n<!-- code: m.py 1-3 -->\n```python\ndef f(x):\n    y = x + 1\n    return y\n```\n"


def test_checker_accepts_a_faithful_quote():
    assert check_note("n.md", NOTE, {"m.py": CODE}.get) == []


def test_checker_reports_an_edited_line():
    problems = check_note("n.md", NOTE, {"m.py": CODE.replace("x + 1", "x + 2")}.get)
    assert len(problems) == 1
    assert "n.md:4 [m.py 1-3]" in problems[0] and "line 2 of m.py" in problems[0]
    assert "'    y = x + 2'" in problems[0] and "'    y = x + 1'" in problems[0]


def test_checker_reports_code_that_moved_and_fix_renumbers_it():
    moved = "import os\n" + CODE
    problems = check_note("n.md", NOTE, {"m.py": moved}.get)
    assert len(problems) == 1 and "moved to lines 2-4" in problems[0]
    fixed = fix_note(NOTE, {"m.py": moved}.get)
    assert "<!-- code: m.py 2-4 -->" in fixed
    assert check_note("n.md", fixed, {"m.py": moved}.get) == []


def test_checker_reports_a_quote_without_marker_and_a_missing_file():
    bare = "text\n```python\nx = 1\n```\n"
    assert "no '<!-- code:" in check_note("n.md", bare, {}.get)[0]
    assert "no file m.py" in check_note("n.md", NOTE, {}.get)[0]
    assert "not followed by" in check_note("n.md", "<!-- code: m.py 1-3 -->\ntext\n", {}.get)[0]
    # other fences (shape diagrams, shell commands) need no marker
    assert check_note("n.md", "```text\n(B, T, E)\n```\n```bash\nmake test\n```\n", {}.get) == []


if __name__ == "__main__":
    if sys.argv[1:] == ["--fix"]:
        for note in NOTE_FILES:
            text = note.read_text(encoding="utf-8")
            fixed = fix_note(text, read_project_file)
            if fixed != text:
                note.write_text(fixed, encoding="utf-8")
                print(f"renumbered quotes in notes/{note.name}")
    left = [p for note in NOTE_FILES
            for p in check_note(f"notes/{note.name}", note.read_text(encoding="utf-8"), read_project_file)]
    print("\n".join(left) or "all quotes match the code")
    sys.exit(1 if left else 0)
