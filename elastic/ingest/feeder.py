"""One reader per host for the job's lifetime: the ``HostFeeder`` actor. The driver's
``HostReaders`` that keep one per reading host, and the rank-side stream they feed, are in
``elastic.ingest.host_readers``.

The global sample order is ``elastic.ingest.corpus``'s: row ``i`` of the corpus in index order,
epochs wrapping. A feeder reads that stream shard by shard (one GET per shard, verified
against the index's sha256), a bounded number of shards ahead of the slowest rank it
serves, and serves any contiguous range of rows from memory. Every rank of a model
replica asks the feeder on its replica leader's host, so a TP or PP group reads storage
once; replicas whose leaders share a host share one read. The feeder holds no CPU of the
training workers (``num_cpus=0``); ranks on other hosts receive batches through Ray's
object store.

Feeders belong to the driver and outlive reconfigurations: after a resize or a recovery
from memory, a host whose feeder already holds (or is reading) the next rows goes on from
where it was, with no process, index read or Ray Data executor to start. Engine
``ray_data`` reads through one Ray Data streaming executor per feeder, kept across steps
and reconfigurations; it is rebuilt only when the stream must jump (a rollback past what
is kept, or a restore from storage of an older step), or after ``SEGMENT_UNITS`` shards.
Engine ``threads`` reads with the feeder's own threads. Staggering (``waves``) and the
per-host read cap are applied here. See docs/data.md.

Runs in the ``HostFeeder`` actor, one per reading host. The window of shards it keeps (rows
to shards, eviction) is its base class in ``feeder_window.py``; the shard reads and engine
``ray_data``'s executor are in ``feeder_reads.py``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import ray
from ray.actor import ActorClass

from elastic.ingest.feeder_reads import build_executor, close_executor, decode_shard
from elastic.ingest.feeder_window import FeederWindow
from elastic.ingest.index import read_index
from elastic.ingest.rounds import wave_of
from storage import open_storage

log = logging.getLogger(__name__)

__all__ = ["HostFeeder"]


class _HostFeeder(FeederWindow):
    """The ``HostFeeder`` actor's body (the module docstring); Ray's handle is ``HostFeeder``."""

    def __init__(
        self,
        root: str,
        storage_options: dict[str, Any],
        rows_ahead: int,
        rows_behind: int,
        max_reads: int,
        timeout_s: float,
        engine: str = "threads",
    ):
        self.root, self.storage_options, self.engine = root, storage_options, engine
        self.fs = open_storage(root, storage_options).fs
        super().__init__(rows_ahead, rows_behind)
        self.max_reads, self.timeout_s = max_reads, timeout_s
        self._epoch: str | None = None  # the stream begun last (a layout, or a rollback in it)
        self._continued = False
        self._turn = False  # this host may start reads (its wave's turn came)
        self._reported = True
        self._gate: Any = None  # the WaveGate actor of this stream's waves
        self.host_index = 0
        self._error: BaseException | None = None
        self._stop = False
        self.stats: dict[str, Any] = {
            "gets": 0,
            "bytes_read": 0,
            "wave": 0,
            "gate_wait_s": 0.0,
            "first_read_at": None,
            "streams": 0,  # begin() calls: layouts (and rollbacks) served
            "continued": 0,  # of those, streams that went on without a jump
            "executors": 0,  # Ray Data executors built (engine ray_data)
        }
        if engine == "ray_data":
            self._x = 0  # the current executor; permits of older ones are refused
            self._x_seq = -1  # the stream position (``_seq``) the current executor reads
            self._x_base: int | None = None  # the shard of its position 0 (None until the index is read)
            threading.Thread(target=self._ray_data_reader, daemon=True, name="feeder-ray-data").start()
        else:
            self._pool = ThreadPoolExecutor(max_workers=max(1, max_reads), thread_name_prefix="feeder-read")
            threading.Thread(target=self._schedule, daemon=True, name="feeder-schedule").start()

    def _unit_to_read(self) -> int | None:
        """The next shard of the stream if it should be read now, else None."""
        k = self._next_unit
        if not self._turn or self._error is not None or k is None:
            return None
        return k if k < self._unit_of(self._low_row()) + self.lookahead else None

    # ------------------------------------------------------------------ a new layout
    def begin(self, epoch: str, start_row: int, host_index: int, hosts: int, waves: int, gate: Any = None) -> bool:
        """Serve a new stream from ``start_row`` on (a new layout, or a rollback in one).

        Idempotent per ``epoch``: every rank this feeder serves calls it, the first one
        counts. The stream goes on if this feeder holds or is reading every shard from
        ``start_row``'s on; otherwise it jumps there. Returns whether it went on.
        """
        with self._lock:
            if epoch == self._epoch:
                return self._continued
            self._epoch, self.host_index = epoch, host_index
            self.wave = self.stats["wave"] = wave_of(host_index, hosts, waves)
            self._gate = gate if waves > 1 and hosts > 1 else None
            self._low.clear()
            self._low_default = start_row
            self.stats["streams"] += 1
            self._continued = self.index is not None and self._error is None and self._holds_from(start_row)
            if self._continued:
                self.stats["continued"] += 1
            else:
                self._seq += 1
                self._units.clear()
                self._inflight.clear()
                self._error = None
                self._next_unit = None if self.index is None else self._unit_of(start_row)
            if self.index is not None:
                self._set_lookahead()
            self._turn, self._reported = False, False
            self._lock.notify_all()
            continued, gate, wave = self._continued, self._gate, self.wave
        threading.Thread(target=self._take_turn, args=(epoch, gate, wave, waves), daemon=True).start()
        return continued

    def _take_turn(self, epoch: str, gate: Any, wave: int, waves: int) -> None:
        """Wait for this host's wave (unless its first window is already here), read the
        index on first use, then let the stream read."""
        with self._lock:
            held = self._first_window_held()
        if gate is not None and not held:
            t0 = time.perf_counter()
            try:
                ray.get(gate.wait_turn.remote(wave), timeout=self.timeout_s * (waves + 1))
            except Exception as exc:  # noqa: BLE001 - a dead or slow earlier wave must not stop this one
                log.warning("wave gate: %s; reading anyway", type(exc).__name__)
            self.stats["gate_wait_s"] = time.perf_counter() - t0
        if self.stats["first_read_at"] is None:
            self.stats["first_read_at"] = time.time()
        if self.index is None:
            try:
                index = read_index(self.root, self.storage_options)
                if index is None:
                    raise FileNotFoundError(f"{self.root} has no index.json: not a prepared corpus")
            except BaseException as exc:  # surfaced to every caller of rows()
                with self._lock:
                    self._error = exc
                    self._lock.notify_all()
                return
            with self._lock:
                self._set_index(index)
                self.stats["gets"] += 1
        with self._lock:
            if self._epoch == epoch:
                self._turn = True
                self._check_first_window()
                self._lock.notify_all()

    def _check_first_window(self) -> None:
        """Tell the gate, once, that this host's first window is read (lock held)."""
        if not self._reported and self._first_window_held():
            self._reported = True
            if self._gate is not None:
                self._gate.done.remote(self.host_index)

    def _store(self, k: int, rows: np.ndarray, nbytes: int) -> None:
        self.stats["gets"] += 1
        self.stats["bytes_read"] += nbytes
        self._units[k] = rows
        self._check_first_window()
        self._lock.notify_all()

    # ------------------------------------------------------------------ engine "threads"
    def _schedule(self) -> None:
        """Start reads in order, at most ``max_reads`` in flight, up to ``lookahead`` shards ahead."""
        with self._lock:
            while not self._stop:
                if self.index is not None:
                    self._evict()
                k = self._unit_to_read() if len(self._inflight) < self.max_reads else None
                if k is not None:
                    self._next_unit = k + 1
                    self._inflight.add(k)
                    self._pool.submit(self._read, k, self._seq)
                    continue
                self._lock.wait(timeout=1.0)

    def _read(self, k: int, seq: int) -> None:
        index = self._corpus()
        shard = index.shards[k % self.n]
        try:
            data = self.fs.cat_file(index.uri(shard))  # one GET
            rows = decode_shard(data, shard.sha256, shard.path)
            with self._lock:
                if seq == self._seq:
                    self._store(k, rows, len(data))
        except BaseException as exc:  # surfaced to every caller of rows()
            with self._lock:
                if seq == self._seq:
                    self._error = exc
        finally:
            with self._lock:
                if seq == self._seq:
                    self._inflight.discard(k)
                self._lock.notify_all()

    # ------------------------------------------------------------------ engine "ray_data"
    def _ray_data_reader(self) -> None:
        """Take shards, in order, from one Ray Data streaming executor that lives as long as
        the stream goes on.

        The executor's items are stream positions ``0, 1, ...``; its read tasks (at most
        ``max_reads``) ask this feeder for a *permit* before each GET (``permit``), which
        names the shard and is given only in this host's turn and while the window has
        room. So reads follow consumption and the waves exactly as with engine
        ``threads``; the executor never runs ahead on its own (an object-store cap would
        make it spin a core), and its tasks hold their worker processes between reads. A
        jump (``_seq``) ends the executor: its waiting tasks get no permit and return at
        once; the next one starts from the new position, before this host's turn if it
        comes later, so its processes are up when reading may begin."""
        it: Iterator[dict[str, np.ndarray]] | None = None
        x, spent = 0, False
        while True:
            with self._lock:
                while not self._stop and self._epoch is None:
                    self._lock.wait(timeout=1.0)
                if self._stop:
                    break
                rebuild = it is None or spent or self._x_seq != self._seq
                if rebuild:
                    self._x = x = self._x + 1
                    self._x_seq, self._x_base = self._seq, self._next_unit
                    self._lock.notify_all()  # permits of the old executor end
            try:
                if rebuild or it is None:
                    close_executor(it)
                    it, spent = build_executor(x, self.max_reads, self.storage_options, self.timeout_s), False
                    with self._lock:
                        self.stats["executors"] += 1
                batch = next(it)
            except StopIteration:
                spent = True
                continue
            except BaseException as exc:  # surfaced to every caller of rows()
                close_executor(it)
                it = None
                with self._lock:
                    if self._x_seq == self._seq:
                        self._error = exc
                        self._lock.notify_all()
                continue
            k, nbytes = int(batch["unit"][0]), int(batch["nbytes"][0])
            with self._lock:
                if nbytes < 0 or self._x_seq != self._seq:
                    continue  # a task of an ended executor, or of a stream that jumped
                if k == self._next_unit:
                    self._next_unit = k + 1
                    self._store(k, np.asarray(batch["tokens"][0], dtype=np.int32), nbytes)
                else:  # never expected: the executor keeps the order
                    self._error = RuntimeError(f"Ray Data returned shard {k}, expected {self._next_unit}")
                    self._lock.notify_all()
        close_executor(it)

    def permit(self, x: int, pos: int, timeout_s: float) -> tuple[int, str, str] | None | bool:
        """Asked by a read task of executor ``x`` before reading its stream position ``pos``:
        ``(shard number, uri, sha256)`` once it may read it; None if that executor ended
        (the task returns without reading); False after ``timeout_s`` (ask again)."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while True:
                if self._stop or x != self._x or self._x_seq != self._seq:
                    return None
                if self._x_base is None:
                    self._x_base = self._next_unit
                if self._turn and self._error is None and self._x_base is not None:
                    k = self._x_base + pos
                    if k < self._unit_of(self._low_row()) + self.lookahead:
                        index = self._corpus()
                        shard = index.shards[k % self.n]
                        return k, index.uri(shard), shard.sha256
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._lock.wait(timeout=min(left, 1.0))

    # ------------------------------------------------------------------ serving
    def rows(self, start: int, count: int, key: Any = None, epoch: str | None = None) -> np.ndarray:
        """Global rows ``[start, start + count)`` of stream ``epoch`` (the current one when
        None) as int64 ``[count, seq_len + 1]``. ``key`` names the caller (its DP rank): the
        oldest row any caller still wants bounds the window."""
        deadline = time.monotonic() + self.timeout_s
        parts: list[np.ndarray] = []
        with self._lock:
            if epoch is not None and epoch != self._epoch:  # a rank of an old layout, still prefetching
                raise RuntimeError(f"data feeder: stream {epoch} was replaced by {self._epoch}")
            self._low[key] = start
            if self.index is not None:
                self._evict()
            self._lock.notify_all()
            while self.index is None or self._next_unit is None:
                if self._error is not None:
                    raise RuntimeError(f"data feeder read failed: {self._error}") from self._error
                if not self._lock.wait(timeout=max(0.0, deadline - time.monotonic())):
                    raise TimeoutError(f"data feeder: the index was not read within {self.timeout_s:g}s")
            row, end = start, start + count
            while row < end:
                k = self._unit_of(row)
                while k not in self._units:
                    if self._error is not None:
                        raise RuntimeError(f"data feeder read failed: {self._error}") from self._error
                    if k < self._next_unit and k not in self._inflight:
                        raise RuntimeError(f"rows {row}.. were evicted from the feeder (a rank fell behind)")
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TimeoutError(f"data feeder: rows {row}.. not read within {self.timeout_s:g}s")
                    self._lock.wait(timeout=left)
                unit = self._units[k]
                lo = row - self._unit_start(k)
                take = min(end - row, len(unit) - lo)
                parts.append(unit[lo : lo + take])
                row += take
        return np.concatenate(parts).astype(np.int64)

    def ready(self, epoch: str, timeout_s: float) -> bool:
        """Block until stream ``epoch``'s first window is read (its wave's turn came and went)."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while True:
                if self._epoch != epoch:
                    raise RuntimeError(f"data feeder: stream {epoch} was replaced by {self._epoch}")
                if self._error is not None:
                    raise RuntimeError(f"data feeder read failed: {self._error}") from self._error
                if self._first_window_held():
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"data feeder: the first reads did not finish within {timeout_s:g}s")
                self._lock.wait(timeout=left)

    def ping(self) -> bool:
        return True

    def get_stats(self) -> dict[str, Any]:
        with self._lock:
            return dict(self.stats, cached_units=len(self._units))

    def close(self) -> None:
        with self._lock:
            self._stop = True
            self._lock.notify_all()
        if self.engine != "ray_data":
            self._pool.shutdown(wait=False, cancel_futures=True)


# Applied as a call, not a decorator: mypy keeps a decorated class's own type, so it would not
# know the actor class's .remote()/.options(). The ignore: Ray's stubs for ray.remote(**options)
# list task options only, not the actor option max_concurrency (the feeder serves ranks,
# permits and reads from up to 32 threads at once).
HostFeeder: ActorClass[_HostFeeder] = ray.remote(num_cpus=0, max_concurrency=32)(_HostFeeder)  # type: ignore[call-overload]
