"""How a host feeder's reads are done: one GET each (a whole shard checked against the index's
sha256, a shard's footer checked against its sha256, or a byte range of row groups whose
pages carry checksums).

``fetch`` runs in the ``HostFeeder`` actor (engine ``threads``, ``feeder.py``) and in the Ray
Data read tasks on the feeder's node (engine ``ray_data``, ``feeder_ray_data.py``). See
docs/data.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from elastic.ingest.shard_format import decode_groups, decode_shard, parse_footer


@dataclass(frozen=True)
class Read:
    """One GET of a host feeder (planned by ``FeederWindow._next_read``)."""

    kind: str  # "shard" (a whole shard: one unit), "footer" (a shard's footer) or "groups" (row groups)
    unit: int  # the first stream unit it reads; for "footer", the stream shard
    count: int  # units it reads (0 for "footer")
    uri: str
    start: int  # bytes [start, end) of the file
    end: int
    digest: str  # sha256 of the shard ("shard") or of its footer ("footer", "groups")
    size: int  # the shard's bytes
    group: int  # its first row group ("groups")
    footer: bytes = b""  # the shard's verified footer ("groups")

    @property
    def name(self) -> str:
        return self.uri.rsplit("/", 1)[-1]


# Per process: parsed footers by digest (a read task decodes many reads of one shard).
_FOOTERS: dict[str, Any] = {}


def fetch(fs: Any, read: Read, meta: Any = None) -> tuple[np.ndarray | bytes, int]:
    """Do ``read`` (one GET): ``(int32 rows, or the footer's bytes for "footer", bytes fetched)``.
    ``meta``: the shard's parsed footer for "groups" (parsed from ``read.footer`` when None)."""
    if read.kind == "shard":
        data = fs.cat_file(read.uri)
        return decode_shard(data, read.digest, read.name), len(data)
    data = fs.cat_file(read.uri, start=read.start, end=read.end)
    if len(data) != read.end - read.start:
        raise OSError(f"{read.name}: {len(data)} bytes read of {read.end - read.start} asked (a shorter shard?)")
    if read.kind == "footer":
        parse_footer(data, read.digest, read.name)  # verified here, before anything relies on it
        return data, len(data)
    if meta is None:
        if read.digest not in _FOOTERS:
            _FOOTERS.clear()  # one shard at a time per process is the common case
            _FOOTERS[read.digest] = parse_footer(read.footer, read.digest, read.name)
        meta = _FOOTERS[read.digest]
    return decode_groups(meta, read.size, read.start, data, read.group, read.count, read.name), len(data)
