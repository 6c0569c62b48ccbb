"""Which files of a directory are data (docs/data.md): the one rule for listing a corpus
(``data.source``, ``data.eval_source``) and ``elastic prepare``'s input, local or remote
alike (fsspec). Runs wherever a corpus is listed: the driver's checks, each reader.

A name starting with ``.`` or ``_`` is not data, as Arrow, Spark and Hive treat it: a
half-written ``.part-00001.parquet.tmp`` (or a hidden ``.part-*.parquet``), ``_SUCCESS``,
``_metadata``, and everything under such a directory.
"""

from __future__ import annotations

from typing import Any

HIDDEN = (".", "_")


def hidden(path: str, root: str = "") -> bool:
    """Whether ``path`` (a file found under ``root``) has a hidden name, or is inside a
    hidden directory below ``root``."""
    rel = path[len(root) :] if root and path.startswith(root) else path.rsplit("/", 1)[-1]
    return any(part.startswith(HIDDEN) for part in rel.split("/") if part)


def corpus_files(fs: Any, root: str) -> list[str]:
    """A corpus directory's parquet files, sorted by name, hidden ones left out."""
    return sorted(p for p in fs.ls(root, detail=False) if p.endswith(".parquet") and not hidden(p))


def input_files(fs: Any, root: str) -> list[str]:
    """Every file under ``root`` (at any depth), sorted, hidden ones and those under a hidden
    directory left out."""
    base = fs.info(root)["name"].rstrip("/") + "/"  # as ``find`` names its files (absolute, no protocol)
    return sorted(p for p in fs.find(root) if not hidden(p, base) and not fs.isdir(p))
