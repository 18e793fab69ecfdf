"""Reading and checking the records of the stages' data files: every bad line is a one-line ``UserError`` naming
the file and the line.

* ``expand_files``: globs and folders -> data files; ``read_lines``, ``text_stream``, ``jsonl_stream``,
  ``read_records``: the lines or records of .txt / .jsonl / .json (an array) / .parquet files, lazily where a
  file may be large.
* ``read_jsonl``: rows that must hold given fields as non-empty strings.
* ``read_chat_pairs`` (SFT): conversations in any of ``CHAT_FORMATS`` (ours, alpaca, ``messages``), told apart
  by a file's first record (``chat_format``, ``conversation_of``).
* ``read_preference_pairs`` (RM, DPO): (prompt, chosen, rejected), as strings or as conversations
  (``preference_of``).
* ``read_prompt_files`` (PPO, GRPO, the held-out monitors, generate.py): prompts as strings or conversations
  (``prompt_of``); ``read_prompt_lines`` / ``non_blank_lines`` for one per line.

Nothing here tokenizes: records become ids in ``batching.py`` (chat examples) and ``token_cache.py`` (documents).
"""

from __future__ import annotations

import glob
import json
import os
import sys

from chinese_tokenizer import split_conversation
from plumbing.cli import UserError

DATA_SUFFIXES = (".jsonl", ".json", ".txt", ".parquet")


def expand_files(patterns, what: str) -> list[str]:
    """Glob patterns or directories (a string or a list) -> sorted file paths; a directory stands for its
    ``DATA_SUFFIXES`` files (.jsonl, .json, .txt, .parquet). Raises ``UserError`` when nothing matches."""
    if isinstance(patterns, str):
        patterns = [patterns]
    files = []
    for pattern in patterns:
        matches = []
        for match in sorted(glob.glob(pattern)):
            if os.path.isdir(match):
                inside = sorted(os.path.join(match, name) for name in os.listdir(match)
                                if name.endswith(DATA_SUFFIXES) and not name.startswith("."))
                if not inside:
                    raise UserError(f"{what}: folder {match} holds no {'/'.join(DATA_SUFFIXES)} file; give files "
                                    f"or a folder of them")
                matches += inside
            else:
                matches.append(match)
        if not matches:
            raise UserError(f"{what}: no file matches {pattern}; run `python data/prepare.py` or fix the path")
        files += matches
    for path in files:
        if os.path.isfile(path) and os.path.getsize(path) == 0:
            raise UserError(f"{what}: {path} is empty; give a file with data")
    return files


def read_lines(path: str, what: str = "") -> list[str]:
    """The lines of a UTF-8 text file. Raises ``UserError`` (naming the flag ``what`` that gave the path, if
    given) if it is missing or not UTF-8."""
    where = f"{what} {path}" if what else path
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().splitlines()
    except FileNotFoundError as e:
        raise UserError(f"{where} not found; fix the path (the default data files come from "
                        f"`python data/prepare.py`)") from e
    except UnicodeDecodeError as e:
        raise UserError(f"{where} is not UTF-8 text (bad byte at offset {e.start}); convert it to UTF-8") from e


def read_records(path: str) -> list[tuple[str, object]]:
    """The records of a JSON-lines file, of a ``.json`` file holding one JSON array (how alpaca-style data sets
    are often published) or of a ``.parquet`` file (how the Hub publishes them), each with where it came from
    ("FILE line N", "FILE item N" or "FILE row N") for error messages.

    Blank lines are skipped. Raises ``UserError`` naming the file and line of the first line that is not JSON.
    """
    if path.endswith(".parquet"):
        return list(_parquet_records(path))
    if path.endswith(".json"):
        text = "\n".join(text_stream(path))
        if text.lstrip().startswith("["):
            try:
                items = json.loads(text)
            except ValueError as e:
                raise UserError(f"{path} is not valid JSON ({e.msg} at line {e.lineno}); fix the file") from e
            return [(f"{path} item {i}", item) for i, item in enumerate(items, start=1)]
        if len(text.strip().splitlines()) > 1:  # one object over several lines is no list of records
            try:
                whole = json.loads(text)
            except ValueError:
                whole = None
            if isinstance(whole, dict):
                raise UserError(f"{path} holds one JSON object (keys: {', '.join(list(whole)[:5])}), not records; "
                                f"give an array of records or one record per line (JSON lines)")
    return list(jsonl_stream(path))


def check_fields(where: str, row, fields: tuple[str, ...], optional: tuple[str, ...] = ()) -> None:
    """``row`` must be a JSON object holding each of ``fields`` as a non-empty string (and each of ``optional``, if
    present, as a string). Raises ``UserError`` naming ``where`` and the field."""
    if not isinstance(row, dict):
        raise UserError(f"{where} is not a JSON object; expected fields {list(fields)}")
    for field in fields:
        value = row.get(field)
        if not isinstance(value, str) or not value.strip():
            problem = "is missing" if field not in row else f"is not a non-empty string ({type(value).__name__})"
            raise UserError(f"{where}: field '{field}' {problem}; every line needs {list(fields)}")
    for field in optional:
        if field in row and not isinstance(row[field], str):
            raise UserError(f"{where}: field '{field}' must be a string, got {type(row[field]).__name__}")


def read_jsonl(path: str, fields: tuple[str, ...]) -> list[dict]:
    """Rows of a JSON-lines file (or a ``.json`` array); every row must hold each of ``fields`` as a non-empty
    string.

    Blank lines are skipped. Raises ``UserError`` naming the file and line for the first bad row, or if the file
    holds no row.
    """
    rows = []
    for where, row in read_records(path):
        check_fields(where, row, fields)
        rows.append(row)
    if not rows:
        raise UserError(f"{path} holds no rows; expected JSON lines with fields {list(fields)}")
    return rows


# The conversation formats SFT reads, told apart by the fields of a file's first record.
CHAT_FORMATS = {
    "prompt/response": 'our own {"prompt", "response"}',
    "alpaca": '{"instruction", "input" (optional), "output"}, as in Stanford Alpaca',
    "messages": '{"messages": [{"role", "content"}, ...]}, several turns, as in the OpenAI chat format',
}


def chat_format(row) -> str:
    """Which of ``CHAT_FORMATS`` a record is in (by its fields); "prompt/response" when it has none of the others'."""
    if isinstance(row, dict) and "messages" in row:
        return "messages"
    if isinstance(row, dict) and "instruction" in row:
        return "alpaca"
    return "prompt/response"


def alpaca_user(row: dict) -> str:
    """An alpaca record's user turn: the instruction, then its input (if any) on the next line."""
    return row["instruction"] + ("\n" + row["input"] if row.get("input", "").strip() else "")


def conversation_of(where: str, row, fmt: str) -> list[tuple[str, str]]:
    """One record of format ``fmt`` -> its conversation as ``(role, content)`` pairs (a ``"system"`` field becomes
    the system message, unless the messages start with their own). Raises ``UserError`` naming ``where`` and what
    is wrong (a missing field, a bad message, turns out of order)."""
    if fmt == "prompt/response":
        check_fields(where, row, ("prompt", "response"), ("system",))
        turns = [("user", row["prompt"]), ("assistant", row["response"])]
    elif fmt == "alpaca":
        check_fields(where, row, ("instruction", "output"), ("input", "system"))
        turns = [("user", alpaca_user(row)), ("assistant", row["output"])]
    else:
        turns = turns_of(where, "messages", row.get("messages") if isinstance(row, dict) else None)
    _add_system(where, row, turns)
    try:
        split_conversation(turns, last="assistant")
    except ValueError as e:
        raise UserError(f"{where}: {e}") from e
    return turns


def read_chat_pairs(patterns, what: str, system: str | None = None) -> list[dict]:
    """Every conversation in the files matching ``patterns``, in file order (SFT's data, and the SFT response
    bigram's): rows ``{"messages": [(role, content), ...], "prompt": the last user turn, "response": the last
    assistant turn}``. Each file may be in any of ``CHAT_FORMATS`` (``.jsonl``, or a ``.json`` array), detected
    from its first record.

    A ``system`` text, if given, opens every conversation that has no system message of its own.

    Raises ``UserError`` naming the file and line of a record that does not fit its file's format, or a file with
    no record.
    """
    rows = []
    for path in expand_files(patterns, what):
        records = read_records(path)
        if not records:
            raise UserError(f"{path} holds no rows; expected conversations in one of: "
                            + "; ".join(CHAT_FORMATS.values()))
        fmt = chat_format(records[0][1])
        for where, record in records:
            turns = conversation_of(where, record, fmt)
            if system and turns[0][0] != "system":
                turns.insert(0, ("system", system))
            rows.append({"messages": turns, "prompt": turns[-2][1], "response": turns[-1][1]})
    return rows


def turns_of(where: str, field: str, messages) -> list[tuple[str, str]]:
    """A JSON list of ``{"role", "content"}`` messages -> ``(role, content)`` pairs; ``UserError`` naming ``where``
    and ``field`` when it is not one, or a message's content is empty."""
    if not isinstance(messages, list) or not messages:
        string = "a string or " if field != "messages" else ""  # prompt, chosen and rejected may be strings
        raise UserError(f"{where}: field '{field}' must be {string}a non-empty list of {{\"role\", \"content\"}} "
                        f"messages")
    for i, m in enumerate(messages, start=1):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise UserError(f"{where}: {field} message {i} must be an object with string 'role' and 'content'")
        if not m["content"].strip():
            raise UserError(f"{where}: {field} message {i} ({m['role']}) has empty content; fill it or drop the "
                            f"record")
    return [(m["role"], m["content"]) for m in messages]


def _add_system(where: str, row, turns: list) -> None:
    """A record's ``"system"`` field opens ``turns`` (in place), unless they already start with a system message."""
    system = row.get("system") if isinstance(row, dict) else None
    if system is not None and not isinstance(system, str):
        raise UserError(f"{where}: field 'system' must be a string, got {type(system).__name__}")
    if system and system.strip() and (not turns or turns[0][0] != "system"):
        turns.insert(0, ("system", system))


def preference_of(where: str, row) -> tuple:
    """One preference record -> ``(prompt, chosen, rejected)``: ``prompt`` a string, or a tuple of ``(role, content)``
    turns ending with a user turn (``chinese_tokenizer.apply_chat_template`` takes either).

    Accepted: our ``{"prompt", "chosen", "rejected"}`` strings; ``prompt`` as a list of messages; and ``chosen`` /
    ``rejected`` as whole conversations (lists of messages, with or without a ``prompt`` before them) that differ
    only in their last, assistant, message. Raises ``UserError`` naming ``where`` and the problem.
    """
    if not isinstance(row, dict):
        raise UserError(f"{where} is not a JSON object; expected fields ['prompt', 'chosen', 'rejected']")
    if all(isinstance(row.get(k), str) for k in ("chosen", "rejected")) and isinstance(row.get("prompt"), str):
        check_fields(where, row, ("prompt", "chosen", "rejected"))
        return row["prompt"], row["chosen"], row["rejected"]
    for field in ("chosen", "rejected"):
        if field not in row:
            raise UserError(f"{where}: field '{field}' is missing; every line needs ['prompt', 'chosen', 'rejected'] "
                            f"or chosen/rejected conversations")
    prompt = turns_of(where, "prompt", row["prompt"]) if isinstance(row.get("prompt"), list) else \
        ([("user", row["prompt"])] if isinstance(row.get("prompt"), str) and row["prompt"].strip() else [])
    sides = []
    for field in ("chosen", "rejected"):
        if isinstance(row[field], str):
            sides.append([("assistant", row[field])])
        else:
            sides.append(turns_of(where, field, row[field]))
    (*chosen_context, chosen), (*rejected_context, rejected) = sides
    if chosen[0] != "assistant" or rejected[0] != "assistant":
        raise UserError(f"{where}: the last message of 'chosen' and of 'rejected' must be the assistant's answer")
    if chosen_context != rejected_context:
        raise UserError(f"{where}: 'chosen' and 'rejected' must share every message but their last (the answers)")
    turns = prompt + chosen_context
    try:
        split_conversation(turns, last="user")
    except ValueError as e:
        raise UserError(f"{where}: {e}") from e
    return tuple(turns), chosen[1], rejected[1]


def read_preference_pairs(patterns, what: str) -> list[tuple]:
    """(prompt, chosen, rejected) triples from the jsonl (or .json array) files matching ``patterns``, in file
    order (the RM's and DPO's data); see ``preference_of`` for the accepted records. Raises ``UserError`` naming the
    file and line of a bad record, or a file with none."""
    triples = []
    for path in expand_files(patterns, what):
        records = read_records(path)
        if not records:
            raise UserError(f"{path} holds no rows; expected JSON lines with fields ['prompt', 'chosen', 'rejected']")
        triples += [preference_of(where, record) for where, record in records]
    return triples


def prompt_of(where: str, row):
    """One prompt record -> the prompt: a string, or a tuple of ``(role, content)`` turns ending with a user turn.

    Accepted: our ``{"prompt"}`` (a string or a list of messages); alpaca ``{"instruction", "input"}`` (an
    ``"output"`` is ignored); ``{"messages": [...]}`` ending with a user turn, or with an assistant turn, which is
    dropped (the policy writes its own). A ``"system"`` field opens the conversation. Raises ``UserError`` naming
    ``where`` and the problem.
    """
    if isinstance(row, dict) and isinstance(row.get("prompt"), str) and not row.get("system"):
        check_fields(where, row, ("prompt",))
        return row["prompt"]
    fmt = chat_format(row)
    if fmt == "messages":
        turns = turns_of(where, "messages", row["messages"])
        if turns and turns[-1][0] == "assistant":
            turns = turns[:-1]
    elif fmt == "alpaca":
        check_fields(where, row, ("instruction",), ("input", "system"))
        turns = [("user", alpaca_user(row))]
    elif isinstance(row, dict) and isinstance(row.get("prompt"), list):
        turns = turns_of(where, "prompt", row["prompt"])
    else:
        check_fields(where, row, ("prompt",), ("system",))
        turns = [("user", row["prompt"])]
    _add_system(where, row, turns)
    try:
        split_conversation(turns, last="user")
    except ValueError as e:
        raise UserError(f"{where}: {e}") from e
    return turns[0][1] if len(turns) == 1 else tuple(turns)  # one user turn: the plain string, as before


def non_blank_lines(path: str, what: str, one_per: str | None = None) -> list[str]:
    """The lines of text file ``path`` that are not blank. With ``one_per`` (what is written for each line, e.g.
    "score"), a note on stderr counts the blank lines skipped: the outputs then follow the non-blank lines, not the
    file's line numbers."""
    every = read_lines(path, what)
    lines = [line for line in every if line.strip()]
    if one_per and 0 < len(lines) < len(every):  # none left is the caller's error, which says enough
        print(f"note: skipped {len(every) - len(lines)} blank line(s) of {path}; one {one_per} per non-blank line",
              file=sys.stderr)
    return lines


def read_prompt_lines(path: str, what: str, one_per: str | None = None) -> list[str]:
    """The prompts of a text file, one per line, blank lines skipped (counted on stderr with ``one_per``, see
    ``non_blank_lines``); ``UserError`` if there are none."""
    prompts = non_blank_lines(path, what, one_per)
    if not prompts:
        raise UserError(f"{what} {path} holds no prompt; write one prompt per line")
    return prompts


def read_prompt_files(patterns, what: str) -> list:
    """The prompts in the files matching ``patterns`` (PPO's and GRPO's practice prompts, every aligner's held-out
    ones), in file order: a ``.txt`` file holds one prompt per line (blank lines skipped), as ``generate.py`` reads
    it; see ``prompt_of`` for the records of the others. Raises ``UserError`` naming the file and line of a bad
    record, or a file with none."""
    prompts = []
    for path in expand_files(patterns, what):
        if path.endswith(".txt"):
            prompts += read_prompt_lines(path, what)
            continue
        records = read_records(path)
        if not records:
            raise UserError(f"{path} holds no rows; expected JSON lines with a 'prompt' (or alpaca / messages "
                            f"records)")
        prompts += [prompt_of(where, record) for where, record in records]
    return prompts


def read_tasks(patterns, what: str) -> list[dict]:
    """The verifiable problems in the files matching ``patterns`` (``data/tasks/*.jsonl``), in file order: rows
    ``{"prompt", "answer", "family"}``, every field a non-empty string, the family one that
    ``verifiers.FAMILIES`` can check, an instruction's ``answer`` one ``verifiers.parse_instruction`` reads and a
    sentiment's 正面 or 负面 (a bad one would otherwise surface only when the first answer is scored). Raises
    ``UserError`` naming the file and line of a bad row, or a file with none."""
    from plumbing.verifiers import FAMILIES, SENTIMENTS, parse_instruction

    tasks = []
    for path in expand_files(patterns, what):
        rows = read_records(path)
        if not rows:
            raise UserError(f"{what}: {path} holds no problems; expected JSON lines with 'prompt', 'answer', 'family'")
        for where, row in rows:
            check_fields(where, row, ("prompt", "answer", "family"))
            if row["family"] not in FAMILIES:
                raise UserError(f"{where}: family {row['family']!r} has no checker; use one of {', '.join(FAMILIES)}")
            if row["family"] == "instruction":
                try:
                    parse_instruction(row["answer"])
                except ValueError as exc:
                    raise UserError(f"{where}: {exc}") from None
            if row["family"] == "sentiment" and row["answer"] not in SENTIMENTS:
                raise UserError(f"{where}: a sentiment answer is {' or '.join(SENTIMENTS)}, got {row['answer']!r}")
            tasks.append({"prompt": row["prompt"], "answer": row["answer"], "family": row["family"]})
    return tasks


def shown_prompt(prompt) -> str:
    """A prompt for a table: the string, or a conversation's last user turn after "…" for the turns before it."""
    return prompt if isinstance(prompt, str) else ("… " if len(prompt) > 1 else "") + prompt[-1][1]


def read_json_or_empty(path: str) -> dict:
    """A small JSON file's object, or {} if it is missing or unreadable (e.g. being replaced)."""
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def open_parquet(path: str):
    """A ``pyarrow.parquet.ParquetFile`` (read in row batches, never whole); ``UserError`` if it is not one."""
    import pyarrow
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path)
    except (OSError, pyarrow.ArrowException) as e:
        raise UserError(f"{path} is not a parquet file ({e}); fix or convert it") from e


def _parquet_records(path: str):
    """(where, record) for each row of a parquet file, read one row group batch at a time."""
    number = 0
    for batch in open_parquet(path).iter_batches(batch_size=1024):
        for record in batch.to_pylist():
            number += 1
            yield f"{path} row {number}", record


def text_stream(path: str, progress=None):
    """The lines of a UTF-8 text file without their line ends, read lazily (``UserError`` if not UTF-8);
    ``progress(n)``, if given, is told of each n bytes read."""
    try:
        f = open(path, encoding="utf-8", newline=None)  # universal newlines: CRLF and CR become "\n"
    except FileNotFoundError as e:
        raise UserError(f"{path} not found; fix the path (the default data files come from "
                        f"`python data/prepare.py`)") from e
    with f:
        told = 0
        try:
            for number, line in enumerate(f, start=1):
                if progress is not None and number % 4096 == 0:
                    position = f.buffer.tell()  # the bytes read so far, in the reader's 8 KB steps
                    progress(position - told)
                    told = position
                yield line.rstrip("\n")
        except UnicodeDecodeError as e:  # e.start counts within the chunk being decoded, which ends at tell()
            offset = f.buffer.tell() - len(e.object) + e.start
            raise UserError(f"{path} is not UTF-8 text (bad byte at offset {offset}); convert it to UTF-8") from e
        if progress is not None:
            progress(os.fstat(f.fileno()).st_size - told)


def jsonl_stream(path: str, progress=None):
    """(where, record) for each non-blank line of a JSON-lines file, read lazily."""
    for number, line in enumerate(text_stream(path, progress), start=1):
        if not line.strip():
            continue
        try:
            yield f"{path} line {number}", json.loads(line)
        except ValueError as e:
            raise UserError(f"{path} line {number} is not valid JSON ({e.msg} at column {e.colno}); fix or remove "
                            f"that line") from e
