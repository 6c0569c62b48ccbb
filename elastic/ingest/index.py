"""The index of a prepared corpus: ``index.json`` next to its parquet shards.

It names every shard in order with its row count, byte size and sha256, plus the
tokenizer and ``seq_len``. Readers take the row counts from it instead of opening every
shard's footer (one GET instead of one per shard), and verify each shard they fetch.
The index is written last: a directory without one is not a finished corpus.

Version 2 adds, per shard, where its parquet footer lies (``footer_offset``,
``footer_bytes``: the last bytes of the file, length and magic included), the footer's
sha256 and ``rows_per_group``: every row group holds that many rows but the last. With
them a host reader fetches the footer alone (one ranged GET, verified) and then only the
byte ranges of the row groups its replicas consume (``elastic.ingest.units``,
``elastic.ingest.shard_format``). A version 1 index (no such fields) is read whole-shard,
as before. See docs/data.md.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from storage import open_storage

INDEX = "index.json"
VERSION = 2
_V2_FIELDS = ("footer_offset", "footer_bytes", "footer_sha256", "rows_per_group")


@dataclass(frozen=True)
class Shard:
    path: str  # relative to the corpus root
    rows: int
    bytes: int
    sha256: str
    # version 2: the footer's place and digest, and the rows of each row group (None: version 1)
    footer_offset: int | None = None
    footer_bytes: int | None = None
    footer_sha256: str | None = None
    rows_per_group: int | None = None

    @property
    def ranged(self) -> bool:
        """Whether its row groups can be read alone (a version 2 entry)."""
        return self.rows_per_group is not None and self.footer_offset is not None

    @property
    def groups(self) -> int:
        """Row groups a reader addresses: each of ``rows_per_group`` rows, or the whole shard (v1)."""
        return -(-self.rows // self.rows_per_group) if self.ranged and self.rows_per_group else 1

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        return d if self.ranged else {k: v for k, v in d.items() if k not in _V2_FIELDS}


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

    @property
    def version(self) -> int:
        """2 when every shard says where its footer and row groups are, else 1."""
        return 2 if self.shards and all(s.ranged for s in self.shards) else 1

    def uri(self, shard: Shard) -> str:
        return f"{self.root.rstrip('/')}/{shard.path}"

    def to_json(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "seq_len": self.seq_len,
            "row_width": self.seq_len + 1,
            "rows": self.num_rows,
            "tokens": self.num_rows * (self.seq_len + 1),
            "tokenizer": self.tokenizer,
            "shards": [s.to_json() for s in self.shards],
        }


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write_index(root: str, index: CorpusIndex, storage_options: dict[str, Any] | None = None) -> None:
    store = open_storage(root, storage_options)
    store.put_bytes(store.join(root, INDEX), json.dumps(index.to_json(), indent=1, sort_keys=True).encode())


def parse_index(root: str, data: bytes) -> CorpusIndex:
    """An ``index.json``'s bytes as a ``CorpusIndex`` (version 1 or 2). A version 2 entry that
    lacks one of its fields is read as version 1 (whole-shard reads)."""
    raw = json.loads(data)
    if int(raw.get("version", 1)) > VERSION:
        raise ValueError(f"{INDEX} version {raw['version']} is newer than this reader (version {VERSION})")
    shards = []
    for s in raw["shards"]:
        v2 = {k: s[k] for k in _V2_FIELDS if k in s} if all(k in s for k in _V2_FIELDS) else {}
        shards.append(Shard(path=s["path"], rows=int(s["rows"]), bytes=int(s["bytes"]), sha256=s["sha256"], **v2))
    return CorpusIndex(root=root, seq_len=int(raw["seq_len"]), tokenizer=raw["tokenizer"], shards=tuple(shards))


def read_index(root: str, storage_options: dict[str, Any] | None = None) -> CorpusIndex | None:
    """The corpus index under ``root``, or None when there is none (a plain parquet corpus)."""
    raw = read_index_bytes(root, storage_options)
    return None if raw is None else parse_index(root, raw)


def read_index_bytes(root: str, storage_options: dict[str, Any] | None = None) -> bytes | None:
    """``index.json``'s bytes (one GET; no HEAD first), or None when there is none."""
    store = open_storage(root, storage_options)
    try:
        return store.get_bytes(store.join(root, INDEX))
    except FileNotFoundError:
        return None
