"""An offline text corpus: files on this machine, read in a deterministic order.

The default corpus is the Python standard library source of the running interpreter
(``sysconfig.get_paths()["stdlib"]``): real, varied text that exists on every machine with Python and needs no
network. Local ``.txt``/``.md``/``.py`` files, JSONL (a ``text`` field per line) and Parquet (a ``text`` column)
can be added; Parquet goes through `datasets` when it is installed, else `pyarrow`.

Example::

    >>> from k3infra.train.corpus import Corpus
    >>> corpus = Corpus.from_paths(None, max_bytes=1 << 20)   # 1 MiB of the stdlib
    >>> len(corpus.documents) > 10, len(corpus.fingerprint)
    (True, 64)
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sysconfig
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst")
"""Files read whole as one document each."""

_SKIP_DIRS = {"site-packages", "__pycache__", "dist-packages"}
_STDLIB_TEST_DIRS = {"test", "tests", "idle_test"}


def stdlib_root() -> Path:
    """The standard library directory of the running interpreter."""
    return Path(sysconfig.get_paths()["stdlib"])


@dataclass(frozen=True)
class Corpus:
    """A list of documents (strings) and a fingerprint of their content.

    Attributes:
        documents: the texts, in the order they were read (sorted paths, lines of a JSONL in order).
        sources: the files they came from (one entry per file, sorted).
        fingerprint: SHA-256 hex digest of every document, so caches keyed by it are invalidated by any change.
    """

    documents: tuple[str, ...]
    sources: tuple[str, ...]
    fingerprint: str

    @property
    def num_bytes(self) -> int:
        """UTF-8 size of all documents together."""
        return sum(len(d.encode("utf-8")) for d in self.documents)

    @classmethod
    def from_paths(cls, paths: Sequence[str | Path] | None = None, *, max_bytes: int | None = None) -> Corpus:
        """Read documents from ``paths`` (files or directories; directories are walked in sorted order).

        Args:
            paths: files or folders; ``None`` or empty means the standard library source (``.py`` files, its
                ``test`` folders and ``site-packages`` left out).
            max_bytes: stop adding documents once this many UTF-8 bytes were read (``None``: read all).

        Raises:
            ValueError: ``max_bytes`` is not positive, a path does not exist, or no document was found.
        """
        if max_bytes is not None and max_bytes < 1:
            raise ValueError(f"max_bytes must be a positive int or None, got {max_bytes!r}")
        default = not paths
        roots = [stdlib_root()] if default else [Path(p) for p in paths]
        for root in roots:
            if not root.exists():
                raise ValueError(f"corpus path {str(root)!r} does not exist")
        documents: list[str] = []
        sources: list[str] = []
        digest = hashlib.sha256()
        total = 0
        for file in _files(roots, stdlib_only=default):
            added = False
            for text in _read_documents(file):
                if not text.strip():
                    continue
                documents.append(text)
                data = text.encode("utf-8")
                digest.update(len(data).to_bytes(8, "little"))
                digest.update(data)
                total += len(data)
                added = True
                if max_bytes is not None and total >= max_bytes:
                    break
            if added:
                sources.append(str(file))
            if max_bytes is not None and total >= max_bytes:
                break
        if not documents:
            raise ValueError(f"no documents found under {[str(r) for r in roots]} (expected {TEXT_SUFFIXES}, "
                             ".jsonl or .parquet files)")
        logger.info("corpus: %d documents, %d bytes from %d files", len(documents), total, len(sources))
        return cls(tuple(documents), tuple(sources), digest.hexdigest())


def _files(roots: list[Path], *, stdlib_only: bool) -> Iterator[Path]:
    for root in roots:
        if root.is_file():
            yield root
            continue
        for file in _walk_sorted(root, stdlib_only):
            if file.suffix in TEXT_SUFFIXES or file.suffix in (".jsonl", ".parquet"):
                yield file


def _walk_sorted(folder: Path, stdlib_only: bool) -> Iterator[Path]:
    """The files under ``folder`` in sorted-path order (each folder's entries by name, a subfolder's files where
    its name sorts), never entering `_SKIP_DIRS` (nor test folders, nor anything but ``.py`` files, with
    ``stdlib_only``)."""
    try:
        entries = sorted(os.scandir(folder), key=lambda e: e.name)
    except OSError:
        return
    for entry in entries:
        if entry.is_dir(follow_symlinks=False):  # as Path.rglob: symlinked folders are not entered
            if entry.name in _SKIP_DIRS or (stdlib_only and entry.name in _STDLIB_TEST_DIRS):
                continue
            yield from _walk_sorted(Path(entry.path), stdlib_only)
        elif entry.is_file() and not (stdlib_only and not entry.name.endswith(".py")):
            yield Path(entry.path)


def _read_documents(file: Path) -> Iterator[str]:
    if file.suffix == ".jsonl":
        with file.open(encoding="utf-8") as handle:
            for number, line in enumerate(handle, 1):
                if not line.strip():
                    continue
                record = json.loads(line)
                if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                    raise ValueError(f"{file}:{number}: each JSONL line must be an object with a string 'text'")
                yield record["text"]
    elif file.suffix == ".parquet":
        yield from _read_parquet(file)
    else:
        yield file.read_text(encoding="utf-8", errors="replace")


def _read_parquet(file: Path) -> Iterator[str]:
    try:
        import datasets
    except ImportError:
        datasets = None
    if datasets is not None:
        table = datasets.Dataset.from_parquet(str(file))
        if "text" not in table.column_names:
            raise ValueError(f"{file}: a Parquet corpus needs a 'text' column, found {table.column_names}")
        yield from table["text"]
        return
    import pyarrow.parquet as pq

    table = pq.read_table(file)
    if "text" not in table.column_names:
        raise ValueError(f"{file}: a Parquet corpus needs a 'text' column, found {table.column_names}")
    yield from table.column("text").to_pylist()
