"""A rendezvous the controller can call off.

``init_process_group`` blocks in its store until every rank has joined, for up to the
process-group timeout. When a member is lost during a reconfiguration, the others would
sit out that whole timeout. Cutting their connections does not help: a TCPStore client
reconnects and keeps waiting. So every blocking store read here is made of short waits,
and between them the rank checks whether the controller has abandoned this rendezvous
(``cancelled()``); if so it fails at once. Connecting to the host's store is retried the
same way.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Callable

import torch.distributed as dist

SLICE_S = 0.5


class RendezvousCancelled(RuntimeError):
    """The controller gave up on this rendezvous (a member was lost)."""


class CancellableStore(dist.Store):
    """Delegates to a real store; blocking reads wait in slices and stop once cancelled."""

    def __init__(self, inner: dist.Store, cancelled: Callable[[], bool], timeout: timedelta):
        super().__init__()
        self._inner, self._cancelled, self._timeout = inner, cancelled, timeout

    # blocking reads -------------------------------------------------------------------
    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        deadline = time.monotonic() + (timeout or self._timeout).total_seconds()
        while True:
            if self._cancelled():
                raise RendezvousCancelled("rendezvous abandoned: a peer was lost")
            left = deadline - time.monotonic()
            try:
                self._inner.wait(keys, timedelta(seconds=max(0.01, min(SLICE_S, left))))
                return
            except dist.DistStoreError:
                if time.monotonic() >= deadline:
                    raise

    def get(self, key: str) -> bytes:
        self.wait([key])
        return self._inner.get(key)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self.wait(keys)
        return self._inner.multi_get(keys)

    # everything else goes straight through ---------------------------------------------
    def set(self, key: str, value) -> None:
        self._inner.set(key, value)

    def multi_set(self, keys: list[str], values: list) -> None:
        self._inner.multi_set(keys, values)

    def add(self, key: str, value: int) -> int:
        return self._inner.add(key, value)

    def append(self, key: str, value) -> None:
        self._inner.append(key, value)

    def compare_set(self, key: str, expected, desired) -> bytes:
        return self._inner.compare_set(key, expected, desired)

    def check(self, keys: list[str]) -> bool:
        return self._inner.check(keys)

    def delete_key(self, key: str) -> bool:
        return self._inner.delete_key(key)

    def num_keys(self) -> int:
        return self._inner.num_keys()

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout

    def has_extended_api(self) -> bool:
        return self._inner.has_extended_api()

    def clone(self) -> CancellableStore:
        return CancellableStore(self._inner.clone(), self._cancelled, self._timeout)


def open_store(host: str, port: int, rank: int, world: int, timeout: timedelta, cancelled: Callable[[], bool]) -> CancellableStore:
    """Rank 0 serves the store on ``port``; the others connect, retrying until ``timeout``
    unless cancelled first."""
    if rank == 0:
        inner = dist.TCPStore(host, port, world, is_master=True, timeout=timeout, wait_for_workers=False)
        return CancellableStore(inner, cancelled, timeout)
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        if cancelled():
            raise RendezvousCancelled("rendezvous abandoned before it was reached: a peer was lost")
        left = deadline - time.monotonic()
        try:
            inner = dist.TCPStore(host, port, world, is_master=False, timeout=timedelta(seconds=max(0.1, min(2.0, left))))
            inner.set_timeout(timeout)
            return CancellableStore(inner, cancelled, timeout)
        except (dist.DistNetworkError, dist.DistStoreError, RuntimeError):
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.1)
