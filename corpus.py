"""Reading and checking the stages' data files, and packing text into training blocks.

* ``read_jsonl(path, fields)``: a list of dicts, each checked to hold every field as a non-empty string; any bad
  line is a one-line ``UserError`` naming the file and line.
* ``load_text_documents(patterns)``: a ``TextDocuments`` stream of pretraining documents from ``.txt`` files
  (documents separated by a blank line), ``.jsonl`` / ``.json`` / ``.parquet`` records (the text in
  ``--text_field``), folders and globs of them, and ``datasets`` datasets (a Hub name or a local dataset folder);
  nothing is read until it is iterated, so a corpus larger than memory is fine.
* ``PackedBlocks``: the documents tokenized once, as they are read, into a flat uint16 token file in the
  ``datasets`` cache (keyed by the files and the tokenizer), joined with ``[SEP]`` and cut into blocks of
  ``context_length + 1`` tokens: block i gives ``input_ids = tokens[iL : iL+L]`` and
  ``labels = tokens[iL+1 : iL+L+1]``, the same tokens shifted by one, each read from the file when it is asked for.
* ``pad_right(sequences)``: variable-length id lists -> a right-padded ``input_ids`` and its ``attention_mask``.
* ``chat_example`` / ``ChatPairs`` / ``collate_chat``: (prompt, response) pairs through the chat template into
  supervised fine-tuning examples: ``input_ids = ids[:-1]`` and ``labels = ids[1:]`` kept only where the next token
  belongs to the response (-100 elsewhere), right-padded into batches with an ``attention_mask``.
* ``length_grouped_batches(lengths, batch_size)``: examples of similar length grouped into fixed batches, so a
  batch wastes little padding; a ``training.BatchSchedule`` then shuffles whole batches.
"""

from __future__ import annotations

import glob
import itertools
import json
import os
import re
import sys

import numpy as np
import torch

from chinese_tokenizer import PAD_ID, SEP_ID, chat_conversation_ids, normalize_text, split_conversation
from cli import UserError


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
        text = "\n".join(_text_stream(path))
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
    return list(_jsonl_stream(path))


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


def shown_prompt(prompt) -> str:
    """A prompt for a table: the string, or a conversation's last user turn after "…" for the turns before it."""
    return prompt if isinstance(prompt, str) else ("… " if len(prompt) > 1 else "") + prompt[-1][1]


def _file_documents(path: str, text_field: str, progress):
    """The documents of one file, read as a stream: a .txt file's documents are separated by a blank line, a
    .jsonl file holds one JSON object per line with the text in ``text_field`` (a .json file may also be one array
    of them), a .parquet file has a ``text_field`` column. ``progress(n)`` is told of each n bytes read. Raises
    ``UserError`` naming the file and line (or row) of a bad record, or a file with no document."""
    found = False
    if path.endswith(".parquet"):
        parquet = _open_parquet(path)
        columns = parquet.schema_arrow.names
        if text_field not in columns:
            raise UserError(f"{path} has no column '{text_field}' (its columns: {', '.join(columns)}); pass "
                            f"--text_field with the column that holds the text")
        size, rows, done = os.path.getsize(path), max(1, parquet.metadata.num_rows), 0
        for batch in parquet.iter_batches(batch_size=1024, columns=[text_field]):
            for text in batch.column(0).to_pylist():
                done += 1
                if not isinstance(text, str) or not text.strip():
                    raise UserError(f"{path} row {done}: column '{text_field}' is not a non-empty string; drop or fix "
                                    f"that row")
                found = True
                yield normalize_text(text)
            progress(size * len(batch) // rows)
    elif path.endswith((".jsonl", ".json")):
        # a .json file may be one array (read whole: such files are small); .jsonl is read line by line
        records = read_records(path) if path.endswith(".json") else _jsonl_stream(path, progress)
        for where, row in records:
            if isinstance(row, dict) and text_field not in row:
                raise UserError(f"{where}: field '{text_field}' is missing (its fields: {', '.join(list(row)[:8])}); "
                                f"pass --text_field with the field that holds the text")
            check_fields(where, row, (text_field,))
            found = True
            yield normalize_text(row[text_field])
        if path.endswith(".json"):
            progress(os.path.getsize(path))
    else:
        lines = []
        for line in itertools.chain(_text_stream(path, progress), [""]):  # an empty line ends a document
            if line:
                lines.append(line)
                continue
            text = "\n".join(lines).strip()
            lines = []
            if text:
                found = True
                yield text
    if not found:
        raise UserError(f"{path} holds no text; give a file with documents")


def _open_parquet(path: str):
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
    for batch in _open_parquet(path).iter_batches(batch_size=1024):
        for record in batch.to_pylist():
            number += 1
            yield f"{path} row {number}", record


def _text_stream(path: str, progress=None):
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


def _jsonl_stream(path: str, progress=None):
    """(where, record) for each non-blank line of a JSON-lines file, read lazily."""
    for number, line in enumerate(_text_stream(path, progress), start=1):
        if not line.strip():
            continue
        try:
            yield f"{path} line {number}", json.loads(line)
        except ValueError as e:
            raise UserError(f"{path} line {number} is not valid JSON ({e.msg} at column {e.colno}); fix or remove "
                            f"that line") from e


SAVED_FILES = {"state.json", "dataset_dict.json"}  # written by save_to_disk: read with load_from_disk
DATASET_FILES = SAVED_FILES | {"dataset_info.json", "dataset_infos.json"}  # datasets' own metadata


def _dataset_folder(path: str) -> bool:
    """Whether the folder ``path`` is a ``datasets`` dataset, not a folder of data files: one written by
    ``save_to_disk`` (``state.json`` / ``dataset_dict.json``), a dataset repository cloned from the Hub (its files
    under ``data/``, or ``datasets``' metadata files), or a folder with no data file directly in it."""
    names = set(os.listdir(path))
    return bool(DATASET_FILES & names) or os.path.isdir(os.path.join(path, "data")) or not any(
        n.endswith(DATA_SUFFIXES) and not n.startswith(".") for n in names)


def _dataset_spec(pattern: str):
    """``(name, config, split)`` when ``pattern`` stands for a ``datasets`` dataset rather than data files: a
    dataset folder (``_dataset_folder``), or a name that is no local path, ``NAME[:CONFIG]:SPLIT`` (e.g.
    ``wikimedia/wikipedia:20231101.zh:train[:1%]``) whose first part is no local folder. None for files, folders of
    files, globs and mistyped local paths."""
    base, bracket, rows = pattern.partition("[")  # a split may select rows: train[:1%] (its colon is no separator)
    if glob.has_magic(base) or (bracket and ":" not in base):  # a glob, not a dataset
        return None
    if os.path.isdir(pattern):
        return (pattern, None, None) if _dataset_folder(pattern) else None
    if os.path.exists(pattern):
        return None
    name, *rest = base.split(":")
    if rest and bracket:
        rest[-1] += bracket + rows
    hub_name = re.fullmatch(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?", name) and not os.path.isdir(name.split("/")[0])
    if len(rest) > 2 or name.endswith(DATA_SUFFIXES) or not (os.path.isdir(name) or hub_name):
        return None  # e.g. data/pretrian: a mistyped local path (its folder exists), not a Hub name
    config, split = rest if len(rest) == 2 else (None, rest[0] if rest else None)
    return name, config or None, split or None


def _saved_split(ds, name: str, split: str | None, what: str):
    """The split ``split`` (``train`` when None; row slices like ``train[:90%]`` too) of a dataset written by
    ``save_to_disk``: a ``DatasetDict``'s split, or a single ``Dataset``, which is its only split, ``train``."""
    import datasets

    splits = ds if isinstance(ds, datasets.DatasetDict) else {"train": ds}
    try:
        wanted = datasets.ReadInstruction.from_spec(split or "train").to_absolute(
            {key: len(value) for key, value in splits.items()})
    except (ValueError, KeyError, AssertionError) as e:
        one = "" if isinstance(ds, datasets.DatasetDict) else "a single dataset, whose only split is train; "
        raise UserError(f"{what}: {name} has no split '{split}' ({one}its splits: {', '.join(splits)}); write "
                        f"{name}:SPLIT, e.g. {name}:train[:90%]") from e
    return datasets.concatenate_datasets([splits[part.splitname].select(range(part.from_, part.to))
                                          for part in wanted])


def _load_dataset(spec, pattern: str, what: str, text_field: str):
    """The ``datasets.Dataset`` that ``_dataset_spec`` found in ``pattern`` (the Hub's are downloaded once into the
    ``datasets`` cache). Raises ``UserError`` when ``datasets`` cannot load it or it has no ``text_field``."""
    import datasets

    name, config, split = spec
    try:
        if os.path.isdir(name) and SAVED_FILES & set(os.listdir(name)):
            ds = _saved_split(datasets.load_from_disk(name), name, split, what)
        else:
            ds = datasets.load_dataset(name, config, split=split or "train")
    except UserError:
        raise
    except Exception as e:  # datasets raises many kinds (no such repository, offline, unknown split or config)
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UserError(f"{what}: {pattern} is no data file, and datasets could not load it as a dataset "
                        f"({reason[:200]}); give .txt/.jsonl/.json/.parquet files, folders or globs, or a dataset "
                        f"as NAME, NAME:SPLIT or NAME:CONFIG:SPLIT") from e
    if text_field not in ds.column_names:
        raise UserError(f"{what}: dataset {pattern} has no column '{text_field}' (its columns: "
                        f"{', '.join(ds.column_names)}); pass --text_field with the column that holds the text")
    return ds


class TextDocuments:
    """A pretraining corpus as a stream of documents: data files (.txt with documents separated by a blank line,
    .jsonl / .json / .parquet with the text in ``text_field``), folders and globs of them, and ``datasets``
    datasets (a Hub name or a local dataset folder, see ``_dataset_spec``), in the order given.

    Nothing is read until the documents are iterated: ``iter(documents)`` yields each document's text.
    ``documents.key`` identifies the content: the files' paths, sizes and modification times, and the datasets'
    fingerprints (so an edited file gives a new key); ``documents.num_bytes`` is the input's size, for progress;
    ``documents.files`` the data files' real paths.

    Raises ``UserError`` (here) for a pattern that matches nothing, an empty file or a dataset that does not load,
    and (while iterating) for bad UTF-8, bad JSON or a record without its text, naming the file and line.
    """

    def __init__(self, patterns, what: str, text_field: str = "text"):
        self.what, self.text_field, self.parts = what, text_field, []  # parts: file paths and (pattern, Dataset)
        for pattern in [patterns] if isinstance(patterns, str) else patterns:
            spec = _dataset_spec(pattern)
            if spec is not None:
                self.parts.append((pattern, _load_dataset(spec, pattern, what, text_field)))
                continue
            for match in (sorted(glob.glob(pattern)) or [pattern]) if glob.has_magic(pattern) else [pattern]:
                if os.path.isdir(match) and _dataset_folder(match):  # a glob over dataset folders
                    self.parts.append((match, _load_dataset((match, None, None), match, what, text_field)))
                else:
                    self.parts += [os.path.realpath(path) for path in expand_files(match, what)]
        self.files = [p for p in self.parts if isinstance(p, str)]
        self.num_bytes = sum(os.path.getsize(p) if isinstance(p, str) else p[1].data.nbytes for p in self.parts)

    @property
    def key(self) -> str:
        described = [(p, os.path.getsize(p), os.stat(p).st_mtime_ns) if isinstance(p, str) else p[1]._fingerprint
                     for p in self.parts]
        return json.dumps([described, self.text_field], ensure_ascii=False)

    @property
    def lineage(self) -> str:
        """Which corpus this is, whatever its content now: the paths and dataset names without their sizes, times or
        fingerprints (an edited file keeps its lineage and gets a new key)."""
        return json.dumps([[p if isinstance(p, str) else p[0] for p in self.parts], self.text_field],
                          ensure_ascii=False)

    def __iter__(self):
        return self.stream(lambda n: None)

    def stream(self, progress):
        """The documents' texts in order; ``progress(n)`` is told of each n input bytes read."""
        for part in self.parts:
            if isinstance(part, str):
                yield from _file_documents(part, self.text_field, progress)
                continue
            pattern, ds = part
            done = 0
            for batch in ds.select_columns([self.text_field]).iter(batch_size=1024):
                for text in batch[self.text_field]:
                    done += 1
                    if not isinstance(text, str) or not text.strip():
                        raise UserError(f"{self.what}: {pattern} row {done} has no text in '{self.text_field}'; "
                                        f"filter it out or pass another --text_field")
                    yield normalize_text(text)
                progress(ds.data.nbytes * len(batch[self.text_field]) // max(1, len(ds)))


def load_text_documents(patterns, what: str, text_field: str = "text") -> TextDocuments:
    """The documents of ``patterns`` (see ``TextDocuments``), checked to exist; ``what`` names the argument in
    errors, ``text_field`` the field or column of .jsonl/.json/.parquet records and datasets that holds the text."""
    return TextDocuments(patterns, what, text_field)


def tokens_path(documents: TextDocuments, tokenizer, bos_id: int | None) -> str:
    """Where the token file of ``documents`` tokenized by ``tokenizer`` lives: in the ``datasets`` cache, named by
    the documents' key, the tokenizer's vocabulary and the start token (its description sits beside it as .json)."""
    import hashlib

    import datasets

    key = hashlib.sha256(f"{documents.key}|{_vocab_key(tokenizer)}|{bos_id}|v2".encode("utf-8")).hexdigest()[:24]
    return os.path.join(datasets.config.HF_DATASETS_CACHE, "gpt2-zh-tokens", f"{key}.bin")


def _vocab_key(tokenizer) -> str:
    """The whole vocabulary as one string, for the cache keys: another vocabulary gives other token files."""
    return json.dumps(sorted(tokenizer.get_vocab().items()), ensure_ascii=False)


def description_path(path: str) -> str:
    """Where the description ({"dtype", "tokens", "documents", ...}) of the token file ``path`` (.bin) lives."""
    return path[:-len(".bin")] + ".json"


def tokenize_to_file(documents: TextDocuments, tokenizer, path: str, bos_id: int | None, what: str) -> dict:
    """Tokenize ``documents`` as they are read (each followed by ``[SEP]``, preceded by ``bos_id`` if given), 1024
    at a time (the fast tokenizer spreads each batch over the CPU's cores itself), and append the ids to a flat
    file at ``path``: uint16 when the vocabulary fits (BERT-Chinese's 21128 does), else int32. A progress bar
    with an ETA follows the input bytes.

    Memory does not grow with the corpus: no intermediate copy is kept, and the file is written with plain writes
    (pages of a written memory map would count as this process's memory). The file is written beside ``path`` and
    renamed into place after its description at ``description_path(path)`` ({"dtype", "tokens", "documents"}),
    which is returned. Token files of the same corpus lineage, tokenizer and ``bos_id`` from before an edit are then
    deleted: they can never be used again. Raises ``UserError`` for bad input (nothing is left behind).
    """
    import hashlib

    from tqdm.auto import tqdm

    start = [] if bos_id is None else [bos_id]
    dtype = np.dtype(np.uint16 if max(len(tokenizer), SEP_ID, bos_id or 0) < 2 ** 16 else np.int32)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    for stale in glob.glob(glob.escape(path) + ".*.tmp*"):  # left by a run that was killed (SIGKILL) while writing
        if not _pid_alive(int(stale[len(path) + 1:].split(".")[0])):
            os.remove(stale)
    tmp = f"{path}.{os.getpid()}.tmp"
    info = {"dtype": dtype.name, "tokens": 0, "documents": 0}
    lineage = hashlib.sha256(f"{documents.lineage}|{_vocab_key(tokenizer)}|{bos_id}".encode("utf-8")).hexdigest()[:24]
    try:
        with open(tmp, "wb") as f, tqdm(total=documents.num_bytes, unit="B", unit_scale=True, dynamic_ncols=True,
                                        desc=f"tokenizing {what}") as bar:
            texts = documents.stream(bar.update)
            while batch := list(itertools.islice(texts, 1024)):
                ids = tokenizer(batch, add_special_tokens=False)["input_ids"]
                flat = np.fromiter(itertools.chain.from_iterable(start + doc + [SEP_ID] for doc in ids), dtype=dtype)
                f.write(flat.tobytes())
                info["tokens"] += len(flat)
                info["documents"] += len(batch)
        with open(tmp + ".json", "w", encoding="utf-8") as f:
            json.dump({**info, "lineage": lineage, "source": json.loads(documents.key)}, f, ensure_ascii=False)
        os.replace(tmp + ".json", description_path(path))
        os.replace(tmp, path)
    finally:
        for leftover in (tmp, tmp + ".json"):
            if os.path.exists(leftover):
                os.remove(leftover)
    for described in glob.glob(os.path.join(glob.escape(os.path.dirname(path)), "*.json")):
        old = described[:-len(".json")] + ".bin"
        finished = re.fullmatch(r"[0-9a-f]{24}\.json", os.path.basename(described))  # not another run's .tmp
        if finished and old != path and read_json_or_empty(described).get("lineage") == lineage:  # before an edit
            for stale in (old, described):
                if os.path.exists(stale):
                    os.remove(stale)
    return info


def read_json_or_empty(path: str) -> dict:
    """A small JSON file's object, or {} if it is missing or unreadable (e.g. being replaced)."""
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's
        return True
    return True


class PackedBlocks:
    """Documents tokenized, separated by ``[SEP]`` and cut into next-token blocks of ``block_len`` predictions.

    ``len(blocks)`` is the number of blocks; ``blocks[i]`` is ``(input_ids, labels)``, two (block_len,) int64
    tensors, labels shifted by one. With ``bos_id`` (the model's ``cfg.bos_id``, e.g. [CLS] for uer's weights)
    every document also starts with that token, as the model saw its documents in training.

    The tokens are computed once per corpus and tokenizer (``tokenize_to_file``) and then read from disk: a block
    by a plain read of its L + 1 ids (pages of a memory map that blocks touched would stay in the process's resident
    memory, up to the whole file over an epoch); ``tokens`` is the whole (N,) array as a read-only memory map, for
    whoever needs all of it. So a second run starts at once and memory does not grow with the corpus.
    """

    def __init__(self, documents: TextDocuments, tokenizer, block_len: int, what: str = "data",
                 bos_id: int | None = None):
        path = tokens_path(documents, tokenizer, bos_id)
        described = description_path(path)
        if os.path.isfile(path) and os.path.isfile(described):
            with open(described, encoding="utf-8") as f:
                info = json.load(f)
        else:
            info = tokenize_to_file(documents, tokenizer, path, bos_id, what)
        self.path, self.dtype, self.block_len = path, np.dtype(info["dtype"]), block_len
        self.num_documents = info["documents"]
        if (info["tokens"] - 1) // block_len < 1:
            raise UserError(f"{what}: only {info['tokens']} tokens, fewer than one block of {block_len + 1}; "
                            f"give more text or a smaller context")
        self.tokens = np.memmap(path, dtype=self.dtype, mode="r", shape=(info["tokens"],))  # (N,), read lazily

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.block_len

    def __getitem__(self, i: int):
        start = i * self.block_len
        ids = np.fromfile(self.path, dtype=self.dtype, count=self.block_len + 1,
                          offset=self.dtype.itemsize * start)  # (L + 1,)
        chunk = torch.from_numpy(ids.astype(np.int64))
        return chunk[:-1], chunk[1:]

    def collate(self, indices) -> dict:
        """Block indices -> {"input_ids": (B, L), "labels": (B, L)}."""
        pairs = [self[i] for i in indices]
        return {"input_ids": torch.stack([p[0] for p in pairs]), "labels": torch.stack([p[1] for p in pairs])}


def pad_right(sequences, pad_id: int = PAD_ID) -> dict:
    """Lists of ids of any lengths -> {"input_ids": (B, T), "attention_mask": (B, T)}, T the longest length.

    Each row keeps its tokens at positions 0..len-1 and is filled with ``pad_id`` after them; the mask is 1 on
    real tokens and 0 on padding. Raises ``ValueError`` for an empty batch or an empty sequence.
    """
    if not sequences or min(len(s) for s in sequences) == 0:
        raise ValueError("pad_right needs at least one sequence and no empty sequence")
    longest = max(len(s) for s in sequences)
    input_ids = torch.full((len(sequences), longest), pad_id, dtype=torch.long)  # (B, T)
    attention_mask = torch.zeros((len(sequences), longest), dtype=torch.long)  # (B, T)
    for row, seq in enumerate(sequences):
        input_ids[row, :len(seq)] = torch.as_tensor(seq, dtype=torch.long)
        attention_mask[row, :len(seq)] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def pad_left(sequences, pad_id: int = PAD_ID) -> dict:
    """Like ``pad_right`` but padding goes first, so every row ends at the last column: the layout for a batch of
    prompts that ``generate`` continues together. Raises ``ValueError`` for an empty batch or sequence."""
    if not sequences or min(len(s) for s in sequences) == 0:
        raise ValueError("pad_left needs at least one sequence and no empty sequence")
    flipped = pad_right([list(reversed(s)) for s in sequences], pad_id)
    return {k: v.flip(dims=[1]) for k, v in flipped.items()}


def chat_example(input_ids: list[int], response_mask: list[int]) -> tuple[list[int], list[int]]:
    """One chat-template sequence -> (inputs, labels) for next-token training on the response only.

    The shift happens here and only here: position t reads ``input_ids[t]`` and is trained to predict
    ``input_ids[t + 1]``, so ``inputs = input_ids[:-1]`` and ``labels[t] = input_ids[t + 1]`` where
    ``response_mask[t + 1]`` is 1, else -100. The ``[ANS]`` position therefore learns the first response token and
    the last response token learns the closing ``[SEP]``; nothing is learned about the prompt.
    ``gpt_model.next_token_loss`` takes these labels as they are (it does not shift again).
    """
    labels = [token if in_response else -100 for token, in_response in zip(input_ids[1:], response_mask[1:])]
    return input_ids[:-1], labels


def collate_chat(examples) -> dict:
    """(inputs, labels) pairs of any lengths -> {"input_ids", "labels", "attention_mask"}, each (B, T).

    Right padding: ``[PAD]`` ids with label -100 and attention 0 after each row's tokens, so padding changes
    neither the real positions' outputs nor the loss.
    """
    batch = pad_right([inputs for inputs, _ in examples])
    labels = torch.full_like(batch["input_ids"], -100)  # (B, T)
    for row, (_, row_labels) in enumerate(examples):
        labels[row, :len(row_labels)] = torch.as_tensor(row_labels, dtype=torch.long)
    batch["labels"] = labels
    return batch


def length_grouped_batches(lengths, batch_size: int) -> list[list[int]]:
    """Example indices sorted by length (ties by index) and cut into consecutive batches of ``batch_size``.

    The grouping is fixed once, so it is a pure function of the data: shuffling the batches (not the examples)
    with a ``BatchSchedule`` keeps exact resume and still pads little. The last batch may be smaller.
    """
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    return [order[start:start + batch_size] for start in range(0, len(order), batch_size)]


class ChatPairs:
    """Conversations laid out by ``chat_conversation_ids`` as supervised fine-tuning examples: rows of
    ``read_chat_pairs`` (their ``"messages"``), or plain ``{"prompt", "response"}`` rows (one exchange).

    The labels are the assistant turns' tokens (each with its closing ``[SEP]``); every other token has -100.
    ``max_length`` is how many positions the model reads per example (at most its ``context_length``); a
    conversation whose template is longer than ``max_length + 1`` tokens loses its oldest turns, then its system
    text, then the start of its last prompt (its last answer too, from the right, only if that answer alone does
    not fit). Nothing is dropped: ``num_truncated`` counts the cut examples and ``num_response_cut`` those among
    them that lost part of the last answer.

    ``len(pairs)``; ``pairs[i]`` is ``(inputs, labels)`` (lists, see ``chat_example``); ``pairs.lengths[i]`` is
    ``len(inputs)``; ``pairs.collate(indices)`` is a padded batch (see ``collate_chat``).
    """

    def __init__(self, rows, tokenizer, max_length: int):
        if max_length < 3:
            raise ValueError(f"max_length must be >= 3 ([CLS], one prompt token, [ANS]), got {max_length}")
        self.rows, self.max_length = rows, max_length
        self.examples, self.num_truncated, self.num_response_cut = [], 0, 0
        for row in rows:
            turns = row.get("messages") or [("user", row["prompt"]), ("assistant", row["response"])]
            ids, mask, truncated = chat_conversation_ids(turns, tokenizer, max_length + 1)
            self.num_truncated += truncated
            self.num_response_cut += ids[-1] != SEP_ID  # the closing [SEP] is the first thing a response cut loses
            self.examples.append(chat_example(ids, mask))
        self.lengths = [len(inputs) for inputs, _ in self.examples]

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int):
        return self.examples[i]

    def collate(self, indices) -> dict:
        """Example indices -> {"input_ids", "labels", "attention_mask"}, each (B, T), T the longest in the batch."""
        return collate_chat([self.examples[i] for i in indices])

    def truncation_warning(self, what: str) -> str | None:
        """One line saying how many pairs were cut, or None if none was."""
        if not self.num_truncated:
            return None
        response = f", {self.num_response_cut} of them also lost the end of the response" if self.num_response_cut \
            else ""
        # a template of max_length + 1 tokens fills max_length positions: its last token is only a label
        return (f"warning: {self.num_truncated} of {len(self)} {what} pairs do not fit in the {self.max_length} "
                f"positions the model reads; their earliest turns and prompts were cut from the left{response} "
                f"(raise --max_length or shorten them)")
