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
as before.

Version 3 adds, per shard, its row-group sidecar (``elastic.ingest.sidecar``): ``groups_path``,
``groups_bytes`` and ``groups_record_bytes`` (the width of each group's record). With it a host
reader fetches each run of row groups with its groups' own metadata, and never a whole
footer: what it reads of metadata grows with what it consumes, not with the corpus. Its
records are verified against the shard's ``sha256``. The version 2 fields stay (a version 3
entry is a version 2 entry plus the sidecar).

``columns`` (any version; absent means ``tokens`` alone) names the shards' columns when they
hold more than ``tokens``: the SFT columns ``loss_mask`` and ``document_ids`` of
``elastic prepare --format chat``, which only the rank's own reader reads. See docs/data.md.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from elastic.ingest.parquet_corpus import TOKENS
from storage import open_storage

INDEX = "index.json"
VERSION = 3
_V2_FIELDS = ("footer_offset", "footer_bytes", "footer_sha256", "rows_per_group")
_V3_FIELDS = ("groups_path", "groups_bytes", "groups_record_bytes")


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
    # version 3: its row-group sidecar (None: version 1 or 2)
    groups_path: str | None = None  # relative to the corpus root
    groups_bytes: int | None = None
    groups_record_bytes: int | None = None

    @property
    def ranged(self) -> bool:
        """Whether its row groups can be read alone (a version 2 or 3 entry)."""
        return self.rows_per_group is not None and self.footer_offset is not None

    @property
    def sidecar(self) -> bool:
        """Whether its row groups' metadata can be read per group (a version 3 entry)."""
        return self.ranged and self.groups_path is not None and bool(self.groups_record_bytes)

    @property
    def version(self) -> int:
        return 3 if self.sidecar else 2 if self.ranged else 1

    @property
    def groups(self) -> int:
        """Row groups a reader addresses: each of ``rows_per_group`` rows, or the whole shard (v1)."""
        return -(-self.rows // self.rows_per_group) if self.ranged and self.rows_per_group else 1

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        drop = {1: _V2_FIELDS + _V3_FIELDS, 2: _V3_FIELDS, 3: ()}[self.version]
        return {k: v for k, v in d.items() if k not in drop}


@dataclass(frozen=True)
class CorpusIndex:
    root: str
    seq_len: int
    tokenizer: dict[str, Any]
    shards: tuple[Shard, ...]
    columns: tuple[str, ...] = (TOKENS,)  # the shards' columns, ``tokens`` first

    @property
    def host_readable(self) -> bool:
        """Whether the host readers can read it: they read ``tokens`` alone."""
        return self.columns == (TOKENS,)

    @property
    def num_rows(self) -> int:
        return sum(s.rows for s in self.shards)

    @property
    def starts(self) -> np.ndarray:
        """First global row of every shard (within one epoch)."""
        return np.concatenate([[0], np.cumsum([s.rows for s in self.shards])[:-1]]).astype(np.int64)

    @property
    def version(self) -> int:
        """The oldest of its shards' versions: 3 when every shard has a row-group sidecar, 2
        when every one says where its footer and row groups are, else 1."""
        return min((s.version for s in self.shards), default=1)

    def as_version(self, version: int) -> CorpusIndex:
        """The same shards under an index of ``version`` (1 to 3) at most, as an older
        ``elastic prepare`` wrote it: the newer fields dropped (benchmarks and tests)."""
        drop = {1: _V2_FIELDS + _V3_FIELDS, 2: _V3_FIELDS, 3: ()}[version]
        unset: dict[str, Any] = dict.fromkeys(drop)
        shards = tuple(replace(s, **unset) for s in self.shards)
        return replace(self, shards=shards)

    def uri(self, shard: Shard) -> str:
        return f"{self.root.rstrip('/')}/{shard.path}"

    def sidecar_uri(self, shard: Shard) -> str:
        return f"{self.root.rstrip('/')}/{shard.groups_path}"

    def to_json(self) -> dict[str, Any]:
        columns = {} if self.host_readable else {"columns": list(self.columns)}
        return {
            **columns,
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
    """An ``index.json``'s bytes as a ``CorpusIndex`` (version 1, 2 or 3). An entry that lacks
    one of its version's fields is read as the version below (version 1: whole-shard reads)."""
    raw = json.loads(data)
    if int(raw.get("version", 1)) > VERSION:
        raise ValueError(f"{INDEX} version {raw['version']} is newer than this reader (version {VERSION})")
    shards = []
    for s in raw["shards"]:
        v2 = {k: s[k] for k in _V2_FIELDS} if all(k in s for k in _V2_FIELDS) else {}
        v3 = {k: s[k] for k in _V3_FIELDS} if v2 and all(k in s for k in _V3_FIELDS) else {}
        shards.append(Shard(path=s["path"], rows=int(s["rows"]), bytes=int(s["bytes"]), sha256=s["sha256"], **v2, **v3))
    columns = tuple(raw.get("columns", (TOKENS,)))
    return CorpusIndex(
        root=root, seq_len=int(raw["seq_len"]), tokenizer=raw["tokenizer"], shards=tuple(shards), columns=columns
    )


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
