"""How a host feeder's reads are done: a whole shard checked against the index's sha256, a
shard's footer checked against its sha256, a byte range of row groups whose pages carry
checksums (version 2), or a run of row groups with their sidecar records (version 3: two
GETs, one after the other, of the records and then of the chunks they place; every group
checked against its record's digest and its pages' checksums).

``fetch`` runs in the ``HostFeeder`` actor (engine ``threads``, ``feeder.py``) and in the Ray
Data read tasks on the feeder's node (engine ``ray_data``, ``feeder_ray_data.py``). See
docs/data.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from elastic.ingest.index import Shard
from elastic.ingest.shard_format import decode_groups, decode_shard, parse_footer
from elastic.ingest.sidecar import chunks_span, decode_run, parse_records


@dataclass(frozen=True)
class Read:
    """One read of a host feeder (planned by ``FeederWindow.next_read``): one GET, or two
    one after the other for a "run"."""

    kind: str  # "shard" (a whole shard: one unit), "footer" (a shard's footer), "groups" or "run" (row groups)
    unit: int  # the first stream unit it reads; for "footer", the stream shard
    count: int  # units it reads (0 for "footer")
    uri: str
    start: int  # bytes [start, end) of the file ("run": of the sidecar, the records)
    end: int
    digest: str  # sha256 of the shard ("shard", "run") or of its footer ("footer", "groups")
    size: int  # the shard's bytes
    group: int  # its first row group ("groups", "run")
    footer: bytes = b""  # the shard's verified footer ("groups")
    shard: Shard | None = None  # its index entry ("run")
    sidecar: str = ""  # the sidecar's URI ("run")

    @property
    def name(self) -> str:
        return self.uri.rsplit("/", 1)[-1]

    @property
    def gets(self) -> int:
        return 2 if self.kind == "run" else 1


@dataclass(frozen=True)
class Fetched:
    """What a read brought: int32 rows (or a footer's bytes) and the bytes it fetched."""

    got: np.ndarray | bytes
    data_bytes: int  # row groups or whole shards
    meta_bytes: int  # a footer, or a run's sidecar records


# Per process: parsed footers by digest (a read task decodes many reads of one shard).
_FOOTERS: dict[str, Any] = {}


def _get(fs: Any, uri: str, start: int, end: int, name: str) -> bytes:
    data = fs.cat_file(uri, start=start, end=end)
    if len(data) != end - start:
        raise OSError(f"{name}: {len(data)} bytes read of {end - start} asked (a shorter file?)")
    return data


def fetch(fs: Any, read: Read, meta: Any = None) -> Fetched:
    """Do ``read``. ``meta``: the shard's parsed footer for "groups" (parsed from
    ``read.footer`` when None)."""
    if read.kind == "shard":
        data = fs.cat_file(read.uri)
        return Fetched(decode_shard(data, read.digest, read.name), len(data), 0)
    if read.kind == "run":
        if read.shard is None:
            raise ValueError(f"{read.name}: a run read without its index entry")
        blob = _get(fs, read.sidecar, read.start, read.end, read.shard.groups_path or read.sidecar)
        records = parse_records(blob, read.shard, read.group, read.count)
        lo, hi = chunks_span(records)
        data = _get(fs, read.uri, lo, hi, read.name)
        return Fetched(decode_run(records, lo, data, read.shard), len(data), len(blob))
    data = _get(fs, read.uri, read.start, read.end, read.name)
    if read.kind == "footer":
        parse_footer(data, read.digest, read.name)  # verified here, before anything relies on it
        return Fetched(data, 0, len(data))
    if meta is None:
        if read.digest not in _FOOTERS:
            _FOOTERS.clear()  # one shard at a time per process is the common case
            _FOOTERS[read.digest] = parse_footer(read.footer, read.digest, read.name)
        meta = _FOOTERS[read.digest]
    rows = decode_groups(meta, read.size, read.start, data, read.group, read.count, read.name)
    return Fetched(rows, len(data), 0)
