"""Typed errors of the storage layer.

``storage`` may not import ``elastic`` (dependencies point jobs -> elastic -> storage), so it
has its own small hierarchy rooted at :class:`StorageError`. The runtime maps these types onto
its own policies; nobody should switch on message text.
"""

from __future__ import annotations


class StorageError(Exception):
    """Base of every error raised on purpose by ``storage``."""


class StorageUnavailable(StorageError):
    """Storage kept failing with transient errors until the retry deadline passed.

    Raised by writes and reads that retry (see :mod:`storage.retry`). A checkpoint whose upload
    raised this is never committed, so readers never see it.
    """

    def __init__(self, what: str, attempts: int, elapsed_s: float, last_error: BaseException | None):
        self.what = what
        self.attempts = attempts
        self.elapsed_s = elapsed_s
        self.last_error = last_error
        cause = f"{type(last_error).__name__}: {last_error}" if last_error is not None else "unknown"
        super().__init__(f"storage unavailable for {what} after {attempts} attempts in {elapsed_s:.1f}s ({cause})")

    def __reduce__(self):  # crosses Ray's actor boundary: rebuilt from its own arguments
        return (type(self), (self.what, self.attempts, self.elapsed_s, self.last_error))


class CheckpointNotFound(StorageError):
    """No committed checkpoint exists for the requested step (or at all)."""


class ChecksumMismatch(StorageError):
    """Bytes read back differ from what the manifest or metadata recorded at write time."""

    def __init__(self, relpath: str, detail: str):
        self.relpath = relpath
        self.detail = detail
        super().__init__(f"{relpath}: {detail}")

    def __reduce__(self):  # without it a worker's error reached the driver as "Failed to deserialize exception"
        return (type(self), (self.relpath, self.detail))


class UnsafePath(ChecksumMismatch):
    """A checkpoint's manifest or metadata names a file outside its own directory (an absolute
    path, ``..``, a backslash or an empty part): the checkpoint is treated as damaged and the
    file is never opened."""

    def __init__(self, relpath: str, detail: str = "names a path outside its checkpoint directory"):
        super().__init__(relpath, detail)


class IncompleteCheckpoint(StorageError):
    """Rank results do not describe a whole checkpoint (missing shard, overlap, conflict).

    Raised by ``commit_checkpoint`` before anything is committed.
    """


class LayoutMismatch(StorageError):
    """The load target asks for keys, shapes or boxes that the source does not hold."""
