"""One reader per host for the job's lifetime: the ``HostFeeder`` actor. The driver's
``HostReaders`` that keep one per reading host, and the rank-side stream they feed, are in
``elastic.ingest.host_readers``.

The global sample order is ``elastic.ingest.corpus``'s: row ``i`` of the corpus in index order,
epochs wrapping. A feeder reads only the part of that stream its host's replicas consume
(``elastic.ingest.units``): the row groups that overlap their slices of each batch. With a
version 3 index, per run of adjacent row groups one ranged GET of their records in the
shard's sidecar (each group's own footer) and one of their chunks, every group checked
against its record's digest and every page against its CRC: no whole footer is read. With
a version 2 index, a shard's footer first (one ranged GET verified against the index's
sha256), then one ranged GET per run; with a version 1 index, whole shards (one GET each,
verified against the index's sha256). It reads a
bounded number of rows ahead of the slowest rank it serves, and serves any contiguous range
of its rows from memory. Every rank of a model replica asks the feeder on its replica
leader's host, so a TP or PP group reads storage once; replicas whose leaders share a host
share one read. The feeder holds no CPU of the training workers (``num_cpus=0``); ranks on
other hosts receive batches through Ray's object store.

Feeders belong to the driver and outlive reconfigurations: after a resize or a recovery
from memory, a host whose feeder already holds (or is reading) the next rows goes on from
where it was, with no process, index read or Ray Data executor to start. Engine
``ray_data`` reads through one Ray Data streaming executor per feeder, kept across steps
and reconfigurations; it is rebuilt only when the stream must jump (a rollback past what
is kept, or a restore from storage of an older step), or after ``SEGMENT_READS`` reads.
Engine ``threads`` reads with the feeder's own threads. Staggering (``waves``) and the
per-host read cap are applied here. See docs/data.md.

Runs in the ``HostFeeder`` actor, one per reading host. The actor owns its window of units
(what to read next, eviction: a ``FeederWindow``, ``feeder_window.py``, no I/O) and drives
both engines' reads itself; how one read is done is ``feeder_reads.py``'s, and engine
``ray_data``'s executor and read tasks are ``feeder_ray_data.py``'s.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

import numpy as np
import ray
from ray.actor import ActorClass

from elastic.ingest.feeder_ray_data import build_executor, close_executor
from elastic.ingest.feeder_reads import Fetched, Read, fetch
from elastic.ingest.feeder_window import FeederWindow
from elastic.ingest.index import parse_index, read_index_bytes
from elastic.ingest.rounds import wave_of
from elastic.ingest.shard_format import parse_footer
from elastic.ingest.units import StreamRequest
from storage import open_storage

log = logging.getLogger(__name__)

__all__ = ["HostFeeder"]


class _HostFeeder:
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
        # What to read next and what to drop: every window method is called with ``_lock`` held.
        self.window = FeederWindow(rows_ahead, rows_behind)
        self._lock = threading.Condition()
        self.max_reads, self.timeout_s = max_reads, timeout_s
        self._epoch: str | None = None  # the stream begun last (a layout, or a rollback in it)
        self._continued = False
        self._turn = False  # this host may start reads (its wave's turn came)
        self._reported = True
        self._gate: Any = None  # the WaveGate actor of this stream's waves
        self.host_index = 0
        self._error: BaseException | None = None
        self._stop = False
        self._gets_inflight = 0  # GETs started and not finished, of any stream (engine threads)
        self._paused = False  # quiesced: no read starts until the next stream begins
        self._index_lock = threading.Lock()  # one read of the index at a time (it counts as a GET)
        self._index_reading = False
        self.stats: dict[str, Any] = {
            "gets": 0,
            "bytes_read": 0,  # every byte fetched from storage: index, metadata and data
            "index_bytes": 0,
            "footer_bytes": 0,  # metadata: footers (version 2), row groups' sidecar records (version 3)
            "data_bytes": 0,  # row groups, or whole shards of a version 1 index
            "footers": 0,  # metadata reads: footers (version 2), runs' sidecar records (version 3)
            "units_read": 0,  # row groups (or whole shards) read
            "rows_read": 0,
            "rows_served": 0,  # rows handed to ranks (a TP or PP group's ranks each count)
            "wave": 0,
            "gate_wait_s": 0.0,
            "first_read_at": None,
            "streams": 0,  # begin() calls: layouts (and rollbacks) served
            "continued": 0,  # of those, streams that went on without a jump
            "executors": 0,  # Ray Data executors built (engine ray_data)
        }
        if engine == "ray_data":
            self._start_ray_data()
        else:
            self._pool = ThreadPoolExecutor(max_workers=max(1, max_reads), thread_name_prefix="feeder-read")
            threading.Thread(target=self._schedule, daemon=True, name="feeder-schedule").start()

    def _read_now(self) -> Read | None:
        """The next read of the stream if it may start now (lock held)."""
        if not self._turn or self._paused or self._error is not None or self.window.table is None:
            return None
        cap = self.window.request.global_batch if self.window.request is not None else self.window.rows_ahead
        return self.window.next_read(max(1, cap))

    # ------------------------------------------------------------------ a new layout
    def begin(self, req: StreamRequest, gate: Any = None) -> bool:
        """Serve a new stream (``req``: a new layout, or a rollback in one).

        Idempotent per ``req.epoch``: every rank this feeder serves calls it, the first one
        counts. The stream goes on if nothing this feeder dropped or skipped lies at or after
        ``req.start_row``: it keeps what it holds and reads what the new layout's slices need
        and it lacks. Otherwise it jumps there. Returns whether it went on.
        """
        with self._lock:
            if req.epoch == self._epoch:
                return self._continued
            self._epoch, self.host_index = req.epoch, req.host_index
            wave = self.stats["wave"] = wave_of(req.host_index, req.hosts, req.waves)
            self._gate = gate if req.waves > 1 and req.hosts > 1 else None
            self.stats["streams"] += 1
            # Until every wave has read its first window, this host reads nothing past its own:
            # its ranks' prefetch moves the window on before the job's first step.
            self._continued = self.window.begin(req, wave, capped=self._gate is not None, go_on=self._error is None)
            if self._continued:
                self.stats["continued"] += 1
            else:
                self._error = None
            self._turn, self._reported, self._paused = False, False, False
            self._lock.notify_all()
            continued, gate = self._continued, self._gate
        threading.Thread(target=self._take_turn, args=(req.epoch, gate, wave, req.waves), daemon=True).start()
        return continued

    def _take_turn(self, epoch: str, gate: Any, wave: int, waves: int) -> None:
        """Wait for this host's wave (unless its first window is already here), read the
        index on first use, then let the stream read."""
        with self._lock:
            held = self.window.first_window_held()
        if gate is not None and not held:
            t0 = time.perf_counter()
            try:
                ray.get(gate.wait_turn.remote(wave), timeout=self.timeout_s * (waves + 1))
            except Exception as exc:  # noqa: BLE001 - a dead or slow earlier wave must not stop this one
                log.warning("wave gate: %s; reading anyway", type(exc).__name__)
            self.stats["gate_wait_s"] = time.perf_counter() - t0
        if self.stats["first_read_at"] is None:
            self.stats["first_read_at"] = time.time()
        if not self._read_index():
            return
        with self._lock:
            if self._epoch == epoch:
                self._turn = True
                self._check_first_window()
                self._lock.notify_all()
        if gate is not None:
            self._lift_cap(epoch, gate, waves)

    def _read_index(self) -> bool:
        """Read the index on first use (one GET, by one thread: a stream begun while an older
        one's turn reads it waits for that read). False if it cannot be read (the error is
        every caller's of rows())."""
        with self._index_lock:
            if self.window.index is not None:
                return True
            with self._lock:
                self._index_reading = True
            try:
                raw = read_index_bytes(self.root, self.storage_options)
                if raw is None:
                    raise FileNotFoundError(f"{self.root} has no index.json: not a prepared corpus")
                index = parse_index(self.root, raw)
            except BaseException as exc:  # surfaced to every caller of rows()
                with self._lock:
                    self._error, self._index_reading = exc, False
                    self._lock.notify_all()
                return False
            with self._lock:
                self.window.set_index(index)
                self._count(len(raw), "index_bytes")
                self._index_reading = False
                self._lock.notify_all()
            return True

    def _gets_in_flight(self) -> int:
        """This host's GETs started and not finished, of any stream, the index's included
        (lock held): at most ``max_reads``."""
        reads = self._gets_inflight_ray() if self.engine == "ray_data" else self._gets_inflight
        return reads + self._index_reading

    def quiesce(self, timeout_s: float, layout: str | None = None) -> int:
        """Start no read until the next stream begins, and return once none is in flight (or
        after ``timeout_s``): the GETs still in flight. The driver quiesces every reader
        before a new layout's streams begin, so the old layout's reads are over before the
        new one's waves (``HostReaders.plans``), and pauses them (``timeout_s`` 0) when a
        layout ends (``HostReaders.pause``). With ``layout``, only a stream of that layout
        is paused: a later one begun meanwhile reads on."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            if layout is not None and not (self._epoch or "").startswith(f"{layout}-"):
                return self._gets_in_flight()
            self._paused = True
            self._lock.notify_all()
            while (left := self._gets_in_flight()) and time.monotonic() < deadline:
                self._lock.wait(timeout=max(0.0, min(1.0, deadline - time.monotonic())))
            return left

    def _lift_cap(self, epoch: str, gate: Any, waves: int) -> None:
        """Read past the first window once every host's first window is read (all waves had
        their turn), or after the wave timeout (a host that died before reporting)."""
        try:
            ray.get(gate.wait_turn.remote(waves), timeout=self.timeout_s * (waves + 1))
        except Exception as exc:  # noqa: BLE001 - a dead or slow host must not stop this one
            log.warning("wave gate (all waves): %s; reading on anyway", type(exc).__name__)
        with self._lock:
            if self._epoch == epoch:
                self.window.capped = False
                self._lock.notify_all()

    def _check_first_window(self) -> None:
        """Tell the gate, once, that this host's first window is read (lock held)."""
        if not self._reported and self.window.first_window_held():
            self._reported = True
            if self._gate is not None:
                self._gate.done.remote(self.host_index)

    def _count(self, nbytes: int, kind: str) -> None:
        self.stats["gets"] += 1
        self.stats["bytes_read"] += nbytes
        self.stats[kind] += nbytes

    def _count_read(self, gets: int, done: Fetched) -> None:
        """A read's GETs and bytes (lock held), whether or not its result is kept: a read
        that fetched metadata (a footer, a run's records) counts one metadata read."""
        self.stats["gets"] += gets
        self.stats["bytes_read"] += done.data_bytes + done.meta_bytes
        self.stats["data_bytes"] += done.data_bytes
        self.stats["footer_bytes"] += done.meta_bytes
        self.stats["footers"] += done.meta_bytes > 0

    def _store(self, read: Read, done: Fetched, meta: Any) -> None:
        """A read's result (lock held): a verified footer (``meta`` parsed), or rows."""
        self._count_read(read.gets, done)
        if read.kind == "footer":
            self.window.footers_inflight.discard(read.unit)
            self.window.footers[read.unit] = (meta, done.got)
        else:
            rows = cast(np.ndarray, done.got)
            self.stats["units_read"] += read.count
            self.stats["rows_read"] += len(rows)
            self.window.put_units(read.unit, rows)
            self._check_first_window()
        self._lock.notify_all()

    def _failed(self, read: Read, exc: BaseException) -> None:
        """A read that failed (lock held): every caller of rows() is told."""
        self._error = exc
        self.window.footers_inflight.discard(read.unit) if read.kind == "footer" else None
        self._lock.notify_all()

    # ------------------------------------------------------------------ engine "threads"
    def _schedule(self) -> None:
        """Start reads in order, at most ``max_reads`` GETs in flight, up to the window's frontier."""
        with self._lock:
            while not self._stop:
                if self.window.table is not None:
                    self.window.evict()
                read = self._read_now() if self._gets_in_flight() < self.max_reads else None
                if read is not None:
                    meta = None
                    if read.kind == "groups" and self.window.table is not None:
                        meta = self.window.footers[self.window.table.stream_shard(read.unit)][0]
                    self._gets_inflight += 1
                    self._pool.submit(self._read, read, meta, self.window.seq)
                    continue
                self._lock.wait(timeout=1.0)

    def _read(self, read: Read, meta: Any, seq: int) -> None:
        try:
            done = fetch(self.fs, read, meta)
            if read.kind == "footer":
                meta = parse_footer(done.got, read.digest, read.name)  # type: ignore[arg-type]
            with self._lock:
                if seq == self.window.seq:
                    self._store(read, done, meta)
                else:  # a stream that jumped: the bytes were fetched all the same
                    self._count_read(read.gets, done)
        except BaseException as exc:  # surfaced to every caller of rows()
            with self._lock:
                if seq == self.window.seq:
                    self._failed(read, exc)
        finally:
            with self._lock:
                self._gets_inflight -= 1
                self._lock.notify_all()

    # ------------------------------------------------------------------ engine "ray_data"
    def _start_ray_data(self) -> None:
        self._x = 0  # the current executor; permits of older ones are refused
        self._x_seq = -1  # the stream position (``_seq``) the current executor reads
        self._x_reads: dict[int, Read] = {}  # its reads permitted and not yet delivered, by position
        self._x_next = 0  # its next position to plan
        threading.Thread(target=self._ray_data_reader, daemon=True, name="feeder-ray-data").start()

    def _ray_data_reader(self) -> None:
        """Take reads, in order, from one Ray Data streaming executor that lives as long as the
        stream goes on.

        The executor's items are read positions ``0, 1, ...``; its read tasks (at most
        ``max_reads``) ask this feeder for a *permit* before each GET (``permit``), which
        names the read (planned by the window, in order) and is given only in this host's
        turn and while the window has room. So reads follow consumption and the waves
        exactly as with engine ``threads``; the executor never runs ahead on its own (an
        object-store cap would make it spin a core), and its tasks hold their worker
        processes between reads. A jump (``_seq``) ends the executor: its waiting tasks get
        no permit and return at once; the next one starts from the new position, before
        this host's turn if it comes later, so its processes are up when reading may begin."""
        it: Iterator[dict[str, np.ndarray]] | None = None
        x, spent = 0, False
        while True:
            with self._lock:
                while not self._stop and self._epoch is None:
                    self._lock.wait(timeout=1.0)
                if self._stop:
                    break
                rebuild = it is None or spent or self._x_seq != self.window.seq
                # A jump: the old executor's permitted reads may still be doing their GETs;
                # they are taken (and dropped) before a new executor may read, so this host
                # never has more than ``max_reads`` GETs in flight. Its unpermitted tasks get
                # no permit and return at once.
                if rebuild and not (it is not None and not spent and self._x_reads):
                    self._x = x = self._x + 1
                    self._x_seq, self._x_reads, self._x_next = self.window.seq, {}, 0
                    self._lock.notify_all()  # permits of the old executor end
                else:
                    rebuild = False
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
                    if self._x_seq == self.window.seq:
                        self._error = exc
                        self._lock.notify_all()
                continue
            self._take(x, batch)
        close_executor(it)

    def _take(self, x: int, batch: dict[str, np.ndarray]) -> None:
        """One read delivered by executor ``x``: stored if its stream is still the current one."""
        pos, gets = int(batch["pos"][0]), int(batch["gets"][0])
        if gets < 0:
            return  # a task of an ended executor
        with self._lock:
            read = self._x_reads.pop(pos, None) if x == self._x else None
            current = read is not None and self._x_seq == self.window.seq
            self._lock.notify_all()  # a GET less in flight (``quiesce`` waits for none)
        nbytes = (int(batch["data_bytes"][0]), int(batch["meta_bytes"][0]))
        if read is None or not current:
            with self._lock:  # a stream that jumped: the bytes were fetched all the same
                self._count_read(gets, Fetched(b"", *nbytes))
            return
        try:
            if read.kind == "footer":
                got: Any = batch["footer"][0].tobytes()
                meta = parse_footer(got, read.digest, read.name)
            else:
                got, meta = np.asarray(batch["tokens"][0], dtype=np.int32), None
        except BaseException as exc:  # surfaced to every caller of rows()
            with self._lock:
                self._failed(read, exc)
            return
        with self._lock:
            if self._x_seq == self.window.seq:
                self._store(read, Fetched(got, *nbytes), meta)

    def permit(self, x: int, pos: int, timeout_s: float) -> Read | None | bool:
        """Asked by a read task of executor ``x`` before its read number ``pos``: the ``Read``
        once it may do it; None if that executor ended (the task returns without reading);
        False after ``timeout_s`` (ask again)."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while True:
                if self._stop or x != self._x or self._x_seq != self.window.seq:
                    return None
                if pos in self._x_reads:  # asked again after a timeout
                    return self._x_reads[pos]
                if pos == self._x_next and self._gets_in_flight() < self.max_reads:
                    read = self._read_now()
                    if read is not None:
                        self._x_reads[pos], self._x_next = read, pos + 1
                        return read
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._lock.wait(timeout=min(left, 1.0))

    def _gets_inflight_ray(self) -> int:
        """GETs permitted and not yet delivered (lock held), an old executor's still being
        drained after a jump included."""
        return len(self._x_reads)

    # ------------------------------------------------------------------ serving
    def rows(self, start: int, count: int, key: Any = None, epoch: str | None = None) -> np.ndarray:
        """Global rows ``[start, start + count)`` of stream ``epoch`` (the current one when
        None) as int64 ``[count, seq_len + 1]``. ``key`` names the caller (its data shard): the
        oldest row any caller still wants bounds the window."""
        deadline = time.monotonic() + self.timeout_s
        parts: list[np.ndarray] = []
        with self._lock:
            if epoch is not None and epoch != self._epoch:  # a rank of an old layout, still prefetching
                raise RuntimeError(f"data feeder: stream {epoch} was replaced by {self._epoch}")
            self.window.low[key] = start
            if self.window.table is not None:
                self.window.evict()
            self._lock.notify_all()
            while self.window.table is None or self.window.scan is None:
                if self._error is not None:
                    raise RuntimeError(f"data feeder read failed: {self._error}") from self._error
                if not self._lock.wait(timeout=max(0.0, deadline - time.monotonic())):
                    raise TimeoutError(f"data feeder: the index was not read within {self.timeout_s:g}s")
            table, row, end = self.window.table, start, start + count
            while row < end:
                k = table.unit_of(row)
                while k not in self.window.units:
                    if self._error is not None:
                        raise RuntimeError(f"data feeder read failed: {self._error}") from self._error
                    self._check_servable(k, row)
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TimeoutError(f"data feeder: rows {row}.. not read within {self.timeout_s:g}s")
                    self._lock.wait(timeout=left)
                unit = self.window.units[k]
                lo = row - table.span(k)[0]
                take = min(end - row, len(unit) - lo)
                parts.append(unit[lo : lo + take])
                row += take
            self.stats["rows_served"] += count
        return np.concatenate(parts).astype(np.int64)

    def release(self, key: Any, epoch: str | None) -> None:
        """A rank of stream ``epoch`` left it (its layout ended): its rows no longer move the
        window on, so once every rank has left, the reads stop where they are (those in flight
        finish). A stream replaced since is not touched."""
        with self._lock:
            if epoch is None or epoch == self._epoch:
                self.window.low.pop(key, None)
                self._lock.notify_all()

    def _check_servable(self, k: int, row: int) -> None:
        """Unit ``k`` (holding ``row``) is asked for and not here (lock held): an error if it
        never will be."""
        if k < self.window.kept_from:
            raise RuntimeError(f"rows {row}.. were evicted from the feeder (a rank fell behind)")
        if self.window.scan is not None and k < self.window.scan and k not in self.window.inflight:
            if not self.window.needed(k):
                raise RuntimeError(f"rows {row}.. are not in the slices this feeder serves ({self.window.request})")
            raise RuntimeError(f"rows {row}.. were evicted from the feeder (a rank fell behind)")

    def ready(self, epoch: str, timeout_s: float) -> bool:
        """Block until stream ``epoch``'s first window is read (its wave's turn came and went)."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while True:
                if self._epoch != epoch:
                    raise RuntimeError(f"data feeder: stream {epoch} was replaced by {self._epoch}")
                if self._error is not None:
                    raise RuntimeError(f"data feeder read failed: {self._error}") from self._error
                if self.window.first_window_held():
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"data feeder: the first reads did not finish within {timeout_s:g}s")
                self._lock.wait(timeout=left)

    def ping(self) -> bool:
        return True

    def get_stats(self) -> dict[str, Any]:
        with self._lock:
            return dict(self.stats, cached_units=len(self.window.units), cached_footers=len(self.window.footers))

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
