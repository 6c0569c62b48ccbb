"""fsspec-backed sharded checkpoint store (local paths, ``file://``, ``s3://``, ``memory://``).

Layers, bottom up (``storage`` imports neither Ray nor ``elastic``/``jobs``):

- :mod:`storage.fs`: the ``Storage`` protocol over str URIs, ``open_storage``, ``redact``;
- :mod:`storage.retry`: backoff for transient errors, ``StorageUnavailable`` at a deadline;
- :mod:`storage.store`: ``CheckpointStore``: step directories, manifest + ``COMMITTED`` marker,
  verification, retention;
- :mod:`storage.dcp`: collective-free sharded DCP writes, the commit, and resharding loads
  from storage or from in-memory snapshots.
"""

from storage.dcp import (
    CheckpointReader,
    LoadResult,
    RankWriteResult,
    ShardRecord,
    SnapshotReader,
    chunk_boxes,
    commit_checkpoint,
    cpu_snapshot,
    load_into,
    primary_replica,
    write_rank_shard,
)
from storage.errors import (
    CheckpointNotFound,
    ChecksumMismatch,
    IncompleteCheckpoint,
    LayoutMismatch,
    StorageError,
    StorageUnavailable,
    UnsafePath,
)
from storage.fs import FsspecStorage, Storage, open_storage, redact, redact_uri, url_to_fs
from storage.manifest import Damage, FileRecord, Manifest
from storage.retry import RetryPolicy, call_with_retry, is_transient
from storage.store import CheckpointInfo, CheckpointStore, PruneReport

__all__ = [
    "Storage",
    "FsspecStorage",
    "open_storage",
    "redact",
    "redact_uri",
    "url_to_fs",
    "RetryPolicy",
    "call_with_retry",
    "is_transient",
    "CheckpointStore",
    "CheckpointInfo",
    "PruneReport",
    "Damage",
    "FileRecord",
    "Manifest",
    "ShardRecord",
    "RankWriteResult",
    "write_rank_shard",
    "commit_checkpoint",
    "load_into",
    "LoadResult",
    "CheckpointReader",
    "SnapshotReader",
    "chunk_boxes",
    "cpu_snapshot",
    "primary_replica",
    "StorageError",
    "StorageUnavailable",
    "CheckpointNotFound",
    "ChecksumMismatch",
    "IncompleteCheckpoint",
    "LayoutMismatch",
    "UnsafePath",
]
