"""The pretraining corpus tokenized once into a token file on disk, and cut into training blocks.

* ``tokens_path``: where the token file of a corpus lives in the ``datasets`` cache, keyed by the documents'
  ``key``, the tokenizer's whole behaviour (``tokenizer_fingerprint``) and the start token.
* ``tokenize_to_file``: documents -> a flat uint16 (or int32) file of ids, each document followed by ``[SEP]``,
  written as it is read, with a progress bar; the description beside it as .json.
* ``PackedBlocks``: that file cut into blocks of ``context_length + 1`` tokens: block i gives
  ``input_ids = tokens[iL : iL+L]`` and ``labels = tokens[iL+1 : iL+L+1]``, each block read from the file when
  it is asked for.
"""

from __future__ import annotations

import glob
import itertools
import json
import os
import re

import numpy as np
import torch

from chinese_tokenizer import SEP_ID, encode_batch, tokenizer_fingerprint
from plumbing.cli import UserError
from plumbing.documents import TextDocuments
from plumbing.records import read_json_or_empty


def tokens_path(documents: TextDocuments, tokenizer, bos_id: int | None) -> str:
    """Where the token file of ``documents`` tokenized by ``tokenizer`` lives: in the ``datasets`` cache, named by
    the documents' key, everything that decides the tokenizer's ids (``tokenizer_fingerprint``: a tokenizer with the
    same vocabulary but another normaliser gets another file), the start token and the encoding rule's version
    (``TOKENS_VERSION``). Its description sits beside it as .json."""
    import hashlib

    import datasets

    described = f"{documents.key}|{tokenizer_fingerprint(tokenizer)}|{bos_id}|{TOKENS_VERSION}"
    key = hashlib.sha256(described.encode("utf-8")).hexdigest()[:24]
    return os.path.join(datasets.config.HF_DATASETS_CACHE, "gpt2-zh-tokens", f"{key}.bin")


# Bumped when the way documents become ids changes (v3: ``chinese_tokenizer.encode_batch``, special-token names in
# a document are plain text), so that no older token file is read as a new one.
TOKENS_VERSION = "v3"


def description_path(path: str) -> str:
    """Where the description ({"dtype", "tokens", "documents", ...}) of the token file ``path`` (.bin) lives."""
    return path[:-len(".bin")] + ".json"


def tokenize_to_file(documents: TextDocuments, tokenizer, path: str, bos_id: int | None, what: str) -> dict:
    """Tokenize ``documents`` as they are read (each followed by ``[SEP]``, preceded by ``bos_id`` if given), 1024
    at a time by the one rule of ``chinese_tokenizer.encode_batch`` (the fast tokenizer spreads each batch over
    the CPU's cores itself), and append the ids to a flat
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
    lineage = hashlib.sha256(f"{documents.lineage}|{tokenizer_fingerprint(tokenizer)}|{bos_id}".encode()
                             ).hexdigest()[:24]
    try:
        with open(tmp, "wb") as f, tqdm(total=documents.num_bytes, unit="B", unit_scale=True, dynamic_ncols=True,
                                        desc=f"tokenizing {what}") as bar:
            texts = documents.stream(bar.update)
            while batch := list(itertools.islice(texts, 1024)):
                ids = encode_batch(batch, tokenizer)
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
        """Block indices -> {"input_ids": (B, L), "labels": (B, L)}: every block's L + 1 ids gathered in one indexed
        read of a memory map made for this call and dropped at its end, so that no page stays mapped (the reason
        ``__getitem__`` reads plainly). One read per block cost 20 ms for 512 blocks on the dev CPU, time a GPU
        waits between steps."""
        starts = np.asarray(indices, dtype=np.int64)[:, None] * self.block_len  # (B, 1)
        mapped = np.memmap(self.path, dtype=self.dtype, mode="r", shape=self.tokens.shape)
        ids = mapped[starts + np.arange(self.block_len + 1)]  # (B, L + 1), a copy: the map is unmapped below
        del mapped
        chunk = torch.from_numpy(ids.astype(np.int64))
        return {"input_ids": chunk[:, :-1].contiguous(), "labels": chunk[:, 1:].contiguous()}
