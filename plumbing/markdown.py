"""``markdown_table``: the one way this project writes a table for a reader, in the stages' ``samples.md`` files
and on the report card."""

from __future__ import annotations


def markdown_table(headers, rows) -> str:
    """A Markdown table: one header row, then one row per item of ``rows`` (each a sequence of cells).
    ``|`` is escaped and newlines become ``<br>``, so every cell stays in its column."""
    def cell(value) -> str:
        return str(value).replace("|", "\\|").replace("\n", "<br>")

    lines = ["| " + " | ".join(map(cell, headers)) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(map(cell, row)) + " |" for row in rows]
    return "\n".join(lines) + "\n"
