"""What a worker hands over, in its own process: its reports, kept until the node agent
acknowledges them (``ReportQueue``), and its memory snapshots, sent to the peer that keeps
their copies (``peer_sender``). Runs inside the ``TrainWorker`` actor (``actor.py``)."""

from __future__ import annotations

import collections
import threading
from typing import Any

import ray

from elastic.checkpoint.memory_tier import Snapshot


class ReportQueue:
    """The reports the worker's ``poll`` hands over, numbered from 1; ``ready`` is set by
    every append. The trainer only appends. Reports are kept until acked (at most ``KEEP``
    of them: the oldest go first), for a node agent that replaces a lost one."""

    KEEP = 4096

    def __init__(self) -> None:
        self._items: collections.deque[tuple[int, Any]] = collections.deque()
        self._seq = 0
        self._lock = threading.Lock()
        self.ready = threading.Event()

    def append(self, item: Any) -> None:
        with self._lock:
            self._seq += 1
            self._items.append((self._seq, item))
            if len(self._items) > self.KEEP:
                self._items.popleft()
        self.ready.set()

    def has_after(self, have: int) -> bool:
        with self._lock:
            return bool(self._items) and self._items[-1][0] > have

    def take(self, ack: int | None, have: int, keep: bool) -> tuple[int, list[Any]]:
        """(the first's number, the reports after ``have``); those up to ``ack`` are dropped
        first, and without ``keep`` the ones handed over too."""
        with self._lock:
            while self._items and ack is not None and self._items[0][0] <= ack:
                self._items.popleft()
            out = [(s, r) for s, r in self._items if s > have]
            if not keep:
                self._items.clear()
        return (out[0][0] if out else 0), [r for _, r in out]


def peer_sender(peer: Any, timeout_s: float):
    """Deliver a snapshot to ``peer`` (a TrainWorker): serialise now, confirm later."""

    def send(snap: Snapshot):
        ref = peer.store_replica.remote(snap.to_wire())  # the arguments are serialised here

        def delivered() -> None:
            if not ray.get(ref, timeout=timeout_s):
                raise RuntimeError(f"the peer refused the snapshot of step {snap.step}: it has left that layout")

        return delivered

    return send
