"""Reading and checking the stages' data files, and packing text into training blocks.

* ``read_jsonl(path, fields)``: a list of dicts, each checked to hold every field as a non-empty string; any bad
  line is a one-line ``UserError`` naming the file and line.
* ``load_text_documents(patterns)``: a ``datasets.Dataset`` of documents from ``.txt`` files (documents separated by
  a blank line) and/or ``.jsonl`` files (one ``{"text": ...}`` per line), read as a stream into Arrow files in the
  ``datasets`` cache (a corpus larger than memory is fine; a second run opens the cache).
* ``PackedBlocks``: the documents tokenized once with ``datasets.map`` into an int32 token file in the same cache
  (keyed by the files and the tokenizer), joined with ``[SEP]`` and cut into blocks of ``context_length + 1``
  tokens: block i gives ``input_ids = tokens[iL : iL+L]`` and ``labels = tokens[iL+1 : iL+L+1]``, the same tokens
  shifted by one, each read from the file when it is asked for.
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

import numpy as np
import torch

from chinese_tokenizer import PAD_ID, SEP_ID, chat_conversation_ids, normalize_text, split_conversation
from cli import UserError


DATA_SUFFIXES = (".jsonl", ".json", ".txt")


def expand_files(patterns, what: str) -> list[str]:
    """Glob patterns or directories (a string or a list) -> sorted file paths; a directory stands for its
    ``.jsonl``/``.json``/``.txt`` files. Raises ``UserError`` when nothing matches."""
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


def read_lines(path: str) -> list[str]:
    """The lines of a UTF-8 text file. Raises ``UserError`` if it is missing or not UTF-8."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().splitlines()
    except FileNotFoundError as e:
        raise UserError(f"{path} not found; fix the path (the default data files come from "
                        f"`python data/prepare.py`)") from e
    except UnicodeDecodeError as e:
        raise UserError(f"{path} is not UTF-8 text (bad byte at offset {e.start}); convert it to UTF-8") from e


def read_records(path: str) -> list[tuple[str, object]]:
    """The records of a JSON-lines file, or of a ``.json`` file holding one JSON array (how alpaca-style data sets
    are often published), each with where it came from ("FILE line N" or "FILE item N") for error messages.

    Blank lines are skipped. Raises ``UserError`` naming the file and line of the first line that is not JSON.
    """
    if path.endswith(".json"):
        text = "\n".join(_text_stream(path))
        if text.lstrip().startswith("["):
            try:
                items = json.loads(text)
            except ValueError as e:
                raise UserError(f"{path} is not valid JSON ({e.msg} at line {e.lineno}); fix the file") from e
            return [(f"{path} item {i}", item) for i, item in enumerate(items, start=1)]
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


def conversation_of(where: str, row, fmt: str) -> list[tuple[str, str]]:
    """One record of format ``fmt`` -> its conversation as ``(role, content)`` pairs (a ``"system"`` field of a
    prompt/response or alpaca record becomes the system message). Raises ``UserError`` naming ``where`` and what
    is wrong (a missing field, a bad message, turns out of order)."""
    if fmt == "prompt/response":
        check_fields(where, row, ("prompt", "response"), ("system",))
        turns = [("user", row["prompt"]), ("assistant", row["response"])]
    elif fmt == "alpaca":
        check_fields(where, row, ("instruction", "output"), ("input", "system"))
        user = row["instruction"] + ("\n" + row["input"] if row.get("input", "").strip() else "")
        turns = [("user", user), ("assistant", row["output"])]
    else:
        messages = row.get("messages") if isinstance(row, dict) else None
        if not isinstance(messages, list) or not messages:
            raise UserError(f"{where}: field 'messages' must be a non-empty list of {{\"role\", \"content\"}}")
        turns = []
        for i, m in enumerate(messages, start=1):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise UserError(f"{where}: message {i} must be an object with string 'role' and 'content'")
            turns.append((m["role"], m["content"]))
    if fmt != "messages" and row.get("system", "").strip():
        turns.insert(0, ("system", row["system"]))
    try:
        split_conversation(turns, last="assistant")
    except ValueError as e:
        raise UserError(f"{where}: {e}") from e
    return turns


def read_chat_pairs(patterns, what: str) -> list[dict]:
    """Every conversation in the files matching ``patterns``, in file order (SFT's data, and the SFT response
    bigram's): rows ``{"messages": [(role, content), ...], "prompt": the last user turn, "response": the last
    assistant turn}``. Each file may be in any of ``CHAT_FORMATS`` (``.jsonl``, or a ``.json`` array), detected
    from its first record.

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
            rows.append({"messages": turns, "prompt": turns[-2][1], "response": turns[-1][1]})
    return rows


def turns_of(where: str, field: str, messages) -> list[tuple[str, str]]:
    """A JSON list of ``{"role", "content"}`` messages -> ``(role, content)`` pairs; ``UserError`` naming ``where``
    and ``field`` when it is not one."""
    if not isinstance(messages, list) or not messages:
        raise UserError(f"{where}: field '{field}' must be a string or a non-empty list of {{\"role\", \"content\"}}")
    for i, m in enumerate(messages, start=1):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise UserError(f"{where}: {field} message {i} must be an object with string 'role' and 'content'")
    return [(m["role"], m["content"]) for m in messages]


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


def _documents(files: list[tuple[str, int, int]]):
    """The documents of ``files`` ((path, size, mtime) triples) one by one, read as a stream: a .txt file's
    documents are separated by a blank line, a .jsonl file holds one ``{"text"}`` per line (a .json file may also
    be one array of them). Raises ``UserError`` naming the file and line of a bad record, or a file with none."""
    for path, _, _ in files:
        found = False
        if path.endswith((".jsonl", ".json")):
            # a .json file may be one array (read whole: such files are small); .jsonl is read line by line
            records = read_records(path) if path.endswith(".json") else _jsonl_stream(path)
            for where, row in records:
                check_fields(where, row, ("text",))
                found = True
                yield {"text": normalize_text(row["text"])}
        else:
            lines = []
            for line in itertools.chain(_text_stream(path), [""]):  # an empty line ends a document
                if line:
                    lines.append(line)
                    continue
                text = "\n".join(lines).strip()
                lines = []
                if text:
                    found = True
                    yield {"text": text}
        if not found:
            raise UserError(f"{path} holds no text; give a file with documents")


def _text_stream(path: str):
    """The lines of a UTF-8 text file without their line ends, read lazily (``UserError`` if not UTF-8)."""
    try:
        with open(path, encoding="utf-8", newline=None) as f:  # universal newlines: CRLF and CR become "\n"
            for line in f:
                yield line.rstrip("\n")
    except FileNotFoundError as e:
        raise UserError(f"{path} not found; fix the path (the default data files come from "
                        f"`python data/prepare.py`)") from e
    except UnicodeDecodeError as e:
        raise UserError(f"{path} is not UTF-8 text (bad byte at offset {e.start}); convert it to UTF-8") from e


def _jsonl_stream(path: str):
    """(where, record) for each non-blank line of a JSON-lines file, read lazily."""
    for number, line in enumerate(_text_stream(path), start=1):
        if not line.strip():
            continue
        try:
            yield f"{path} line {number}", json.loads(line)
        except ValueError as e:
            raise UserError(f"{path} line {number} is not valid JSON ({e.msg}); fix or remove that line") from e


def load_text_documents(patterns, what: str):
    """A ``datasets.Dataset`` with one column ``text``, one row per document, from .txt files (documents separated
    by a blank line) and .jsonl files (one ``{"text"}`` per line), files and folders and globs.

    The files are read once, as a stream, into Arrow files in the ``datasets`` cache (memory does not grow with
    the corpus); the cache is keyed by the files' paths, sizes and modification times, so a second run with the
    same files opens it at once and an edited file is read again.

    Raises:
        UserError: no file, an empty file, bad UTF-8, or a jsonl line without a "text" string.
    """
    import datasets

    files = [(os.path.realpath(f), os.path.getsize(f), os.stat(f).st_mtime_ns) for f in expand_files(patterns, what)]
    try:
        return datasets.Dataset.from_generator(_documents, gen_kwargs={"files": files})
    except datasets.exceptions.DatasetGenerationError as e:  # our own one-line error, raised inside the reader
        cause = e.__cause__ or e.__context__
        while cause is not None and not isinstance(cause, UserError):
            cause = cause.__cause__ or cause.__context__
        if cause is not None:
            raise cause from None
        raise


def tokens_path(documents, tokenizer, bos_id: int | None) -> str:
    """Where the token file of ``documents`` tokenized by ``tokenizer`` lives: in the ``datasets`` cache, named by
    the documents' fingerprint, the tokenizer's vocabulary and the start token."""
    import hashlib

    import datasets

    vocab = json.dumps(sorted(tokenizer.get_vocab().items()), ensure_ascii=False)
    key = hashlib.sha256(f"{documents._fingerprint}|{vocab}|{bos_id}|int32-v1".encode("utf-8")).hexdigest()[:24]
    return os.path.join(datasets.config.HF_DATASETS_CACHE, "gpt2-zh-tokens", f"{key}.npy")


def tokenize_to_file(documents, tokenizer, path: str, bos_id: int | None, what: str) -> None:
    """Tokenize ``documents`` (each followed by ``[SEP]``, preceded by ``bos_id`` if given) with
    ``datasets.map`` in this process (the fast tokenizer spreads each batch over the CPU's cores itself: on 2 cores
    that was faster than 2 processes, bench/bench_data.py) and write the ids, concatenated, as one int32 ``.npy``
    file at ``path`` (written beside it and renamed into place, chunk by chunk: memory does not grow with it)."""
    start = [] if bos_id is None else [bos_id]

    def tokenize(batch):
        ids = tokenizer(batch["text"], add_special_tokens=False)["input_ids"]
        return {"input_ids": [start + doc + [SEP_ID] for doc in ids], "length": [len(doc) + len(start) + 1
                                                                               for doc in ids]}

    tokenized = documents.map(tokenize, batched=True, remove_columns=documents.column_names,
                              desc=f"tokenizing {what}")
    import pyarrow.compute as pc

    total = int(pc.sum(tokenized.data.column("length")).as_py() or 0)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    written = 0
    with open(tmp, "wb") as f:  # plain writes: pages of a written memory map would count as this process's memory
        np.lib.format.write_array_header_1_0(f, {"descr": np.dtype(np.int32).str, "fortran_order": False,
                                                 "shape": (total,)})
        for chunk in tokenized.data.column("input_ids").chunks:  # Arrow record batches, read from the cache file
            flat = chunk.flatten().to_numpy(zero_copy_only=False).astype(np.int32)
            f.write(flat.tobytes())
            written += len(flat)
    if written != total:
        raise RuntimeError(f"wrote {written} tokens, expected {total}")
    os.replace(tmp, path)


class PackedBlocks:
    """Documents tokenized, separated by ``[SEP]`` and cut into next-token blocks of ``block_len`` predictions.

    ``len(blocks)`` is the number of blocks; ``blocks[i]`` is ``(input_ids, labels)``, two (block_len,) int64
    tensors, labels shifted by one. With ``bos_id`` (the model's ``cfg.bos_id``, e.g. [CLS] for uer's weights)
    every document also starts with that token, as the model saw its documents in training.

    The tokens are computed once per corpus and tokenizer (``tokenize_to_file``) and then read from disk: a block
    by a plain read of its L + 1 ids (pages of a memory map that blocks touched would stay in the process's resident
    memory, up to the whole file over an epoch); ``tokens`` is the whole (N,) int32 array as a read-only memory map,
    for whoever needs all of it. So a second run starts at once and memory does not grow with the corpus.
    """

    def __init__(self, documents, tokenizer, block_len: int, what: str = "data", bos_id: int | None = None):
        path = tokens_path(documents, tokenizer, bos_id)
        if not os.path.isfile(path):
            tokenize_to_file(documents, tokenizer, path, bos_id, what)
        self.path, self.tokens = path, np.load(path, mmap_mode="r")  # (N,) int32, read lazily
        self.block_len = block_len
        self.num_documents = len(documents)
        if len(self) == 0:
            raise UserError(f"{what}: only {len(self.tokens)} tokens, fewer than one block of {block_len + 1}; "
                            f"give more text or a smaller context")

    def __len__(self) -> int:
        return max(0, (len(self.tokens) - 1) // self.block_len)

    def __getitem__(self, i: int):
        start = i * self.block_len
        ids = np.fromfile(self.path, dtype=np.int32, count=self.block_len + 1,
                          offset=self.tokens.offset + 4 * start)  # (L + 1,)
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
        return (f"warning: {self.num_truncated} of {len(self)} {what} pairs are longer than {self.max_length + 1} "
                f"tokens; their earliest turns and prompts were cut from the left{response} (raise --max_length "
                f"or shorten them)")
