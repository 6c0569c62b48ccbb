"""``Checkpoint``: a directory of files, local or in storage, as Ray Train's.

A rank reports one with ``report(metrics, checkpoint=Checkpoint.from_directory(d))``; the
platform reads its files into memory at once (``files``), so the loop may delete ``d`` as
soon as ``report`` returns (the Ray Train examples report from a ``TemporaryDirectory``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator

from storage.fs import open_storage


class Checkpoint:
    """A checkpoint directory at ``path`` (a local path or a storage URI)."""

    def __init__(self, path: str):
        self.path = os.fspath(path)

    @classmethod
    def from_directory(cls, path: str | os.PathLike) -> Checkpoint:
        path = os.fspath(path)
        if not os.path.isdir(path):
            raise ValueError(f"Checkpoint.from_directory: {path!r} is not a directory")
        return cls(os.path.abspath(path))

    def _is_local(self) -> bool:
        return "://" not in self.path or self.path.startswith("file://")

    def to_directory(self, path: str | os.PathLike | None = None) -> str:
        """Copy the checkpoint's files into ``path`` (a new temporary directory when None)."""
        target = os.fspath(path) if path is not None else tempfile.mkdtemp(prefix="checkpoint-")
        os.makedirs(target, exist_ok=True)
        if self._is_local():
            shutil.copytree(self.path.removeprefix("file://"), target, dirs_exist_ok=True)
            return target
        storage = open_storage(self.path, None)
        for rel in storage.sizes(self.path):
            dest = os.path.join(target, rel)
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            with open(dest, "wb") as f:
                f.write(storage.get_bytes(storage.join(self.path, rel)))
        return target

    @contextlib.contextmanager
    def as_directory(self) -> Iterator[str]:
        """The checkpoint as a local directory for the ``with`` block (no copy when local)."""
        if self._is_local():
            yield self.path.removeprefix("file://")
            return
        tmp = self.to_directory()
        try:
            yield tmp
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def __repr__(self) -> str:
        return f"Checkpoint(path={self.path!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Checkpoint) and other.path == self.path

    def __hash__(self) -> int:
        return hash(self.path)


def read_files(path: str) -> dict[str, bytes]:
    """Every file under the local directory ``path``: relative path -> bytes."""
    out: dict[str, bytes] = {}
    for root, _, names in os.walk(path):
        for name in names:
            full = os.path.join(root, name)
            with open(full, "rb") as f:
                out[os.path.relpath(full, path)] = f.read()
    return out


def write_files(files: dict[str, bytes], path: str) -> str:
    for rel, data in files.items():
        dest = os.path.join(path, rel)
        os.makedirs(os.path.dirname(dest) or path, exist_ok=True)
        with open(dest, "wb") as f:
            f.write(data)
    return path
