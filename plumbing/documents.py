"""Pretraining documents from wherever they come: a stream of texts, read only when it is iterated.

* ``TextDocuments`` / ``load_text_documents``: .txt files (documents separated by a blank line), .jsonl / .json /
  .parquet records with the text in ``--text_field``, folders and globs of them, and ``datasets`` datasets (a Hub
  name ``NAME[:CONFIG]:SPLIT`` or a local dataset folder, ``_dataset_spec``). ``key`` names the content (paths,
  sizes, modification times, dataset fingerprints), ``lineage`` the corpus whatever its content now.

Nothing is held in memory: a corpus larger than memory is fine. ``token_cache.py`` turns the stream into tokens.
"""

from __future__ import annotations

import glob
import itertools
import json
import os
import re

from chinese_tokenizer import normalize_text
from plumbing.cli import UserError
from plumbing.records import (
    DATA_SUFFIXES,
    check_fields,
    expand_files,
    jsonl_stream,
    open_parquet,
    read_records,
    text_stream,
)


def _file_documents(path: str, text_field: str, progress):
    """The documents of one file, read as a stream: a .txt file's documents are separated by a blank line, a
    .jsonl file holds one JSON object per line with the text in ``text_field`` (a .json file may also be one array
    of them), a .parquet file has a ``text_field`` column. ``progress(n)`` is told of each n bytes read. Raises
    ``UserError`` naming the file and line (or row) of a bad record, or a file with no document."""
    found = False
    if path.endswith(".parquet"):
        parquet = open_parquet(path)
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
        records = read_records(path) if path.endswith(".json") else jsonl_stream(path, progress)
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
        for line in itertools.chain(text_stream(path, progress), [""]):  # an empty line ends a document
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
