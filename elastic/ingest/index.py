"""The index of a prepared corpus: ``index.json`` next to its parquet shards.

It names every shard in order with its row count, byte size and sha256, plus the
tokenizer and ``seq_len``. Readers take the row counts from it instead of opening every
shard's footer (one GET instead of one per shard), and verify each shard they fetch.
The index is written last: a directory without one is not a finished corpus.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from storage import open_storage

INDEX = "index.json"
VERSION = 1


@dataclass(frozen=True)
class Shard:
    path: str  # relative to the corpus root
    rows: int
    bytes: int
    sha256: str


@dataclass(frozen=True)
class CorpusIndex:
    root: str
    seq_len: int
    tokenizer: dict[str, Any]
    shards: tuple[Shard, ...]

    @property
    def num_rows(self) -> int:
        return sum(s.rows for s in self.shards)

    @property
    def starts(self) -> np.ndarray:
        """First global row of every shard (within one epoch)."""
        return np.concatenate([[0], np.cumsum([s.rows for s in self.shards])[:-1]]).astype(np.int64)

    def uri(self, shard: Shard) -> str:
        return f"{self.root.rstrip('/')}/{shard.path}"

    def to_json(self) -> dict[str, Any]:
        return {
            "version": VERSION,
            "seq_len": self.seq_len,
            "row_width": self.seq_len + 1,
            "rows": self.num_rows,
            "tokens": self.num_rows * (self.seq_len + 1),
            "tokenizer": self.tokenizer,
            "shards": [s.__dict__ for s in self.shards],
        }


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write_index(root: str, index: CorpusIndex, storage_options: dict[str, Any] | None = None) -> None:
    store = open_storage(root, storage_options)
    store.put_bytes(store.join(root, INDEX), json.dumps(index.to_json(), indent=1, sort_keys=True).encode())


def read_index(root: str, storage_options: dict[str, Any] | None = None) -> CorpusIndex | None:
    """The corpus index under ``root``, or None when there is none (a plain parquet corpus)."""
    store = open_storage(root, storage_options)
    try:
        raw = json.loads(store.get_bytes(store.join(root, INDEX)))  # one GET; no HEAD first
    except FileNotFoundError:
        return None
    shards = tuple(Shard(**s) for s in raw["shards"])
    return CorpusIndex(root=root, seq_len=int(raw["seq_len"]), tokenizer=raw["tokenizer"], shards=shards)
