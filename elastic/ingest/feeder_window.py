"""A host feeder's window on the corpus stream: which units (row groups, or whole shards of a
version 1 index) it holds or is reading, which it still needs, what to read next and what to
drop (no I/O and no Ray; the ``HostFeeder`` actor in ``feeder.py`` owns one, so it runs in
that actor).

Units and what a host needs are ``elastic.ingest.units``'s. The window reads, in stream
order, every unit the stream's request needs that starts less than ``rows_ahead`` rows (plus
one unit per wave) past the oldest row any of its ranks still wants, and at least the
stream's first window (``_first_end``), and keeps units back to ``rows_behind`` rows before
it. Adjacent row groups of one shard are coalesced into one read of at most a global batch
of rows: with a version 3 index, their sidecar records and then their chunks; with a
version 2 index, one ranged read after the shard's footer (read once per shard copy along
the stream). Every method whose docstring says "lock held"
is called with the owning feeder's ``_lock`` held.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from elastic.ingest.feeder_reads import Read
from elastic.ingest.index import CorpusIndex
from elastic.ingest.shard_format import groups_span
from elastic.ingest.sidecar import records_span
from elastic.ingest.units import StreamRequest, UnitTable


class FeederWindow:
    """One host feeder's window (the module docstring): its fields are read and written by
    its feeder under the feeder's lock."""

    def __init__(self, rows_ahead: int, rows_behind: int):
        self.rows_ahead, self.rows_behind = rows_ahead, rows_behind
        self.index: CorpusIndex | None = None  # read in this host's first turn: the index is a read too
        self.table: UnitTable | None = None
        self.request: StreamRequest | None = None  # the stream served now
        self.units: dict[int, np.ndarray] = {}  # unit -> its rows
        self.inflight: set[int] = set()  # units being read
        self.footers: dict[int, Any] = {}  # stream shard -> (parsed footer, its bytes)
        self.footers_inflight: set[int] = set()
        self.low: dict[Any, int] = {}  # per serving key (a data shard): the first row it still needs
        self.low_default = 0
        self.scan: int | None = None  # units before it are held, being read, or not needed
        self.kept_from = 0  # units before it were dropped
        self.seq = 0  # bumped when the stream jumps: reads of an older position are dropped
        self.capped = False  # while hosts start in waves: no read past the first window
        self.wave = 0

    def begin(self, req: StreamRequest, wave: int, capped: bool, go_on: bool) -> bool:
        """Serve stream ``req`` (a new layout, or a rollback in one) as this host's wave
        ``wave``; ``capped``: no read past the first window until the waves are read. It goes
        on from what the window holds if ``go_on`` (the feeder has no read error) and nothing
        it needs from ``req.start_row`` was dropped (``can_go_on``); otherwise it jumps there:
        everything held is dropped and reads of the old position (``seq``) are not kept.
        Returns whether it went on (lock held)."""
        self.request, self.wave = req, wave
        self.low.clear()
        self.low_default = req.start_row
        went_on = go_on and self.can_go_on(req.start_row)
        if not went_on:
            self.seq += 1
            self.units.clear()
            self.inflight.clear()
            self.footers.clear()
            self.footers_inflight.clear()
            self.kept_from = 0 if self.table is None else self.table.unit_of(req.start_row)
        self.scan = None if self.table is None else self.table.unit_of(req.start_row)
        self.capped = capped
        return went_on

    def set_index(self, index: CorpusIndex) -> None:
        """The corpus index, once read (lock held)."""
        self.index, self.table = index, UnitTable(index)
        if self.scan is None:
            self.scan = self.kept_from = self.table.unit_of(self.low_default)

    def _corpus(self) -> tuple[CorpusIndex, UnitTable]:
        """The corpus index: read before any unit can be asked for (the stream starts after it)."""
        if self.index is None or self.table is None:
            raise RuntimeError("data feeder: a unit was asked for before the corpus index was read")
        return self.index, self.table

    # ------------------------------------------------------------------ the window
    def _low_row(self) -> int:
        return min(self.low.values()) if self.low else self.low_default

    def _frontier(self) -> int:
        """Units starting before this row are read (lock held): the stream's first window, and
        ``rows_ahead`` rows past the oldest row still wanted, and one unit further per wave, so
        later waves' reads stay apart; while the hosts start in waves, no further than the
        first window."""
        _, table = self._corpus()
        first = self._first_end()
        if self.capped:
            return first
        return max(self._low_row() + self.rows_ahead + self.wave * table.max_unit_rows, first)

    def needed(self, k: int) -> bool:
        _, table = self._corpus()
        return self.request is None or self.request.needs(*table.span(k))

    def _first_end(self) -> int:
        """The end of the stream's first window (lock held, the index read): the farthest the
        window reaches before training consumes anything. Its ranks take up to ``rows_ahead``
        rows at once (their prefetch), and the window reads ``rows_ahead`` rows (and one unit
        per wave) past the oldest of them; so no host reads again before the first step, and
        start-up reads stay within the waves."""
        _, table = self._corpus()
        return self.low_default + 2 * self.rows_ahead + self.wave * table.max_unit_rows

    def first_window_held(self) -> bool:
        """Whether every unit the stream needs in its first window is read (lock held)."""
        if self.table is None:
            return False
        k, end = self.table.unit_of(self.low_default), self._first_end()
        while True:
            start, _ = self.table.span(k)
            if start >= end:
                return True
            if k not in self.units and self.needed(k):
                return False
            k += 1

    def can_go_on(self, row: int) -> bool:
        """Whether a stream from ``row`` continues what this window holds (lock held, the new
        request set): nothing it needs from there was dropped, and ``row`` is within the
        stream's reach (the scan, or the last unit held or being read: the scan itself moves
        on only when the next read is planned, which with engine ``ray_data`` waits for the
        executor's next task). What the new stream needs begins at its first needed unit,
        which may lie past ``row``'s: a host that gets a slice back (a replica returns) needs
        rows from inside the batch, and the units before them may be gone. Units the new stream
        does not need, between the reach and ``row``, do not break it: the scan passes over
        them unread (a host whose slices end before the batch's end has read nothing there)."""
        if self.table is None or self.scan is None:
            return False
        start = first = self.table.unit_of(row)
        last = start if self.request is None else self.table.unit_of(row + self.request.global_batch)
        while first < last and not self.needed(first):  # one batch holds a row of every slice
            first += 1
        reach = max([self.scan, *(k + 1 for k in self.units), *(k + 1 for k in self.inflight)])
        while reach < start and not self.needed(reach):  # what the scan would pass over unread
            reach += 1
        return self.kept_from <= first and start <= reach

    def evict(self) -> None:
        """Drop units wholly before ``rows_behind`` rows under the oldest row still wanted, and
        the footers of shards before them (lock held): a rollback of a step or two still finds
        its rows here."""
        _, table = self._corpus()
        keep = table.unit_of(max(0, self._low_row() - self.rows_behind))
        if keep <= self.kept_from:
            return
        self.kept_from = keep
        for k in [k for k in self.units if k < keep]:
            del self.units[k]
        first_shard = table.stream_shard(keep)
        for s in [s for s in self.footers if s < first_shard]:
            del self.footers[s]

    def next_read(self, cap_rows: int) -> Read | None:
        """The next read of the stream, if one may start now, marked as started (lock held):
        the run of needed units from the next one (of one shard, at most ``cap_rows`` rows),
        with its sidecar records (version 3); for a version 2 shard, its footer first if it
        is not here yet."""
        index, table = self._corpus()
        if self.scan is None:
            return None
        frontier, k = self._frontier(), self.scan
        while True:
            start, _ = table.span(k)
            if start >= frontier:
                return None
            if k in self.units or k in self.inflight or not self.needed(k):
                k += 1
                self.scan = k
                continue
            break
        _, j, g = table.locate(k)
        shard = index.shards[j]
        uri = index.uri(shard)
        if not shard.ranged:
            self.inflight.add(k)
            return Read("shard", k, 1, uri, 0, shard.bytes, shard.sha256, shard.bytes, 0)
        if shard.sidecar:  # version 3: the run's records from the sidecar, then its chunks
            count = self._run(k, frontier, cap_rows)
            lo, hi = records_span(shard, g, count)
            side = index.sidecar_uri(shard)
            return Read("run", k, count, uri, lo, hi, shard.sha256, shard.bytes, g, shard=shard, sidecar=side)
        key = table.stream_shard(k)
        if key not in self.footers:
            if key in self.footers_inflight:
                return None  # its footer is on its way
            self.footers_inflight.add(key)
            off, length = int(shard.footer_offset or 0), int(shard.footer_bytes or 0)
            return Read("footer", key, 0, uri, off, off + length, shard.footer_sha256 or "", shard.bytes, 0)
        count = self._run(k, frontier, cap_rows)
        meta, footer = self.footers[key]
        lo, hi = groups_span(meta, g, count)
        return Read("groups", k, count, uri, lo, hi, shard.footer_sha256 or "", shard.bytes, g, footer)

    def _run(self, k: int, frontier: int, cap_rows: int) -> int:
        """The needed units from ``k`` on that one read takes, marked as being read (lock
        held): adjacent, of one shard, starting before ``frontier``, at most ``cap_rows`` rows."""
        _, table = self._corpus()
        last, rows, count = table.last_unit_of_shard(k), 0, 0
        while k + count <= last:
            u = k + count
            u_start, u_rows = table.span(u)
            if count and (u_start >= frontier or rows + u_rows > cap_rows):
                break
            if u in self.units or u in self.inflight or not self.needed(u):
                break
            rows, count = rows + u_rows, count + 1
        self.inflight.update(range(k, k + count))
        return count

    def put_units(self, first: int, rows: np.ndarray) -> None:
        """Rows read for units ``first ..`` (lock held): split per unit."""
        _, table = self._corpus()
        k, at = first, 0
        while at < len(rows):
            _, n = table.span(k)
            self.units[k] = rows[at : at + n]
            self.inflight.discard(k)
            at, k = at + n, k + 1
