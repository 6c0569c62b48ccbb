"""What a host reader reads, in pure arithmetic (no I/O, no Ray): the corpus stream cut into
read units, and which of them the replicas a host serves will consume.

**Units.** The stream is the corpus in index order, epochs wrapping (``elastic.ingest.corpus``).
A shard with a version 2 index entry is cut into its row groups (``rows_per_group`` rows
each, the last one shorter); a version 1 shard is one unit, read whole. Unit ``k`` of the
stream is unit ``k % U`` of the corpus in epoch ``k // U`` (``U`` units per epoch).

**What a host consumes.** Batch ``b`` is rows ``[b*G, (b+1)*G)``; data shard ``s`` of ``n``
(``n = dp * ep``, ``ParallelDims.data_shards``) takes ``[b*G + s*G/n, b*G + (s+1)*G/n)``. A
host serves the data shards of the replicas whose leader it holds (``served_slices``), so it
needs exactly the units that overlap those ranges in some batch (``StreamRequest.needs``).
The order never depends on which host reads: only which units each host fetches does.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from elastic.ingest.index import CorpusIndex


@dataclass(frozen=True)
class StreamRequest:
    """A layout's stream on one host reader (``HostFeeder.begin``): built by each rank the
    reader serves (``FeederSource.open``); every rank of a host builds the same one."""

    epoch: str  # names the stream: one per layout, and per rollback in it
    start_row: int  # the first row of its first batch: ``start_batch * global_batch``
    global_batch: int  # G, rows per batch
    shards: int  # data shards: slices of each batch (dp * ep)
    served: tuple[int, ...]  # the slices this host's replicas train on, sorted
    host_index: int = 0  # this host among the reading hosts (for the waves)
    hosts: int = 1
    waves: int = 1

    def __post_init__(self) -> None:
        if self.global_batch < 1 or self.shards < 1 or self.global_batch % self.shards:
            raise ValueError(f"global_batch {self.global_batch} is not split evenly into {self.shards} data shards")
        if not self.served or any(not 0 <= s < self.shards for s in self.served):
            raise ValueError(f"served slices {self.served} are not among the {self.shards} data shards")
        if self.start_row < 0:
            raise ValueError(f"start_row {self.start_row} < 0")

    @cached_property
    def intervals(self) -> tuple[tuple[int, int], ...]:
        """The served rows of every batch as ``[lo, hi)`` offsets in it, adjacent slices merged."""
        per = self.global_batch // self.shards
        out: list[list[int]] = []
        for s in sorted(set(self.served)):
            if out and out[-1][1] == s * per:
                out[-1][1] = (s + 1) * per
            else:
                out.append([s * per, (s + 1) * per])
        return tuple((lo, hi) for lo, hi in out)

    def needs(self, start: int, rows: int) -> bool:
        """Whether global rows ``[start, start + rows)`` hold any row this host serves."""
        g = self.global_batch
        if rows >= g:
            return True
        off = start % g
        end = off + rows  # may pass g: the range then reaches into the next batch
        return any(lo < end and off < hi or lo + g < end for lo, hi in self.intervals)


def served_slices(replicas: Iterable[int], replicas_total: int, data_shards: int) -> tuple[int, ...]:
    """The data shards trained on by ``replicas`` (DP ranks) of ``replicas_total``: replica
    ``d`` holds data shards ``d*ep .. d*ep + ep - 1`` (``ParallelDims.data_shard``)."""
    if replicas_total < 1 or data_shards % replicas_total:
        raise ValueError(f"{data_shards} data shards are not a multiple of {replicas_total} replicas")
    ep = data_shards // replicas_total
    return tuple(s for d in sorted(set(replicas)) for s in range(d * ep, (d + 1) * ep))


class UnitTable:
    """Global row <-> stream unit, for an index (memory grows with shards, not with units)."""

    def __init__(self, index: CorpusIndex):
        shards = index.shards
        if not shards:
            raise ValueError("the corpus index lists no shards")
        self.rows = np.asarray([s.rows for s in shards], dtype=np.int64)
        self.per_group = np.asarray([s.rows_per_group if s.ranged else s.rows for s in shards], dtype=np.int64)
        self.groups = np.asarray([s.groups for s in shards], dtype=np.int64)
        self.row_base = np.concatenate([[0], np.cumsum(self.rows)[:-1]]).astype(np.int64)
        self.unit_base = np.concatenate([[0], np.cumsum(self.groups)[:-1]]).astype(np.int64)
        self.n, self.total_rows, self.total_units = len(shards), int(self.rows.sum()), int(self.groups.sum())
        self.max_unit_rows = int(self.per_group.max())

    def unit_of(self, row: int) -> int:
        """The unit holding global row ``row``."""
        epoch, r = divmod(row, self.total_rows)
        j = int(np.searchsorted(self.row_base, r, side="right") - 1)
        return epoch * self.total_units + int(self.unit_base[j]) + int((r - self.row_base[j]) // self.per_group[j])

    def locate(self, k: int) -> tuple[int, int, int]:
        """``(epoch, shard, group)`` of unit ``k``."""
        epoch, u = divmod(k, self.total_units)
        j = int(np.searchsorted(self.unit_base, u, side="right") - 1)
        return epoch, j, u - int(self.unit_base[j])

    def span(self, k: int) -> tuple[int, int]:
        """``(first global row, rows)`` of unit ``k``."""
        epoch, j, g = self.locate(k)
        first = int(self.per_group[j]) * g
        return epoch * self.total_rows + int(self.row_base[j]) + first, min(
            int(self.per_group[j]), int(self.rows[j]) - first
        )

    def stream_shard(self, k: int) -> int:
        """The shard of unit ``k`` counted along the stream (``epoch * shards + shard``)."""
        epoch, j, _ = self.locate(k)
        return epoch * self.n + j

    def last_unit_of_shard(self, k: int) -> int:
        """The last unit of the shard copy that unit ``k`` is in."""
        epoch, j, g = self.locate(k)
        return k - g + int(self.groups[j]) - 1
