"""A host feeder's window on the corpus stream: which shards it holds or is reading, where
each global row lives, and what to drop (no Ray; the base of the ``HostFeeder`` actor in
``feeder.py``, so it runs in that actor).

Shard ``k`` of the stream is shard ``k % n`` of the index in epoch ``k // n``: row ``i`` of
the corpus in index order, epochs wrapping (``elastic.ingest.corpus``'s global order). Every
method whose docstring says "lock held" is called with ``_lock`` held by its caller.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from elastic.ingest.index import CorpusIndex


class FeederWindow:
    def __init__(self, rows_ahead: int, rows_behind: int):
        self.rows_ahead, self.rows_behind = rows_ahead, rows_behind
        self._lock = threading.Condition()
        self.index: CorpusIndex | None = None  # read in this host's first turn: the index is a read too
        self.n, self.total, self.starts = 0, 0, np.zeros(0, dtype=np.int64)  # the index's shards, rows, first rows
        self._units: dict[int, np.ndarray] = {}
        self._inflight: set[int] = set()
        self._low: dict[Any, int] = {}  # per serving key (a DP rank): the first row it still needs
        self._low_default = 0
        self._next_unit: int | None = None  # the next shard to read, in stream order
        self._seq = 0  # bumped when the stream jumps: reads of an older position are dropped
        self.wave, self.lookahead = 0, 1

    def _set_index(self, index: CorpusIndex) -> None:
        """The corpus index, once read (lock held)."""
        self.index, self.n, self.total, self.starts = index, len(index.shards), index.num_rows, index.starts
        self._set_lookahead()
        if self._next_unit is None:
            self._next_unit = self._unit_of(self._low_default)

    def _corpus(self) -> CorpusIndex:
        """The corpus index: read before any shard can be asked for (the stream starts after it)."""
        if self.index is None:
            raise RuntimeError("data feeder: a shard was asked for before the corpus index was read")
        return self.index

    # ------------------------------------------------------------------ global row <-> shard
    def _unit_of(self, row: int) -> int:
        epoch, r = divmod(row, self.total)
        return epoch * self.n + int(np.searchsorted(self.starts, r, side="right") - 1)

    def _unit_start(self, k: int) -> int:
        return (k // self.n) * self.total + int(self.starts[k % self.n])

    # ------------------------------------------------------------------ the window
    def _low_row(self) -> int:
        return min(self._low.values()) if self._low else self._low_default

    def _first_window(self) -> range:
        first = self._unit_of(self._low_default)
        return range(first, first + self.lookahead)

    def _first_window_held(self) -> bool:
        """Whether the stream's first ``lookahead`` shards are read (lock held)."""
        return self.index is not None and all(k in self._units for k in self._first_window())

    def _holds_from(self, row: int) -> bool:
        """Whether every shard from ``row``'s on is held or being read (lock held)."""
        u0 = self._unit_of(row)
        if self._next_unit is None or u0 > self._next_unit:
            return False
        return all(k in self._units or k in self._inflight for k in range(u0, self._next_unit))

    def _set_lookahead(self) -> None:
        # Shards ahead of the oldest row still wanted: enough for ``rows_ahead`` rows, plus one
        # per wave: later waves read further ahead, so their steady-state reads stay apart too.
        smallest = min(s.rows for s in self._corpus().shards)
        self.lookahead = -(-self.rows_ahead // smallest) + 1 + self.wave

    def _evict(self) -> None:
        """Drop shards wholly before ``rows_behind`` rows under the oldest row still wanted
        (lock held): a rollback of a step or two still finds its rows here."""
        keep = self._unit_of(max(0, self._low_row() - self.rows_behind))
        for k in [k for k in self._units if k < keep]:
            del self._units[k]
