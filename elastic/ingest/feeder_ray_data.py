"""Engine ``ray_data`` of a host feeder: its reads done by one Ray Data streaming executor whose
read tasks wait for the feeder's permit before each GET.

``RayDataEngine`` is a base of the ``HostFeeder`` actor (``feeder.py``) and runs in it, as do
``build_executor`` and ``close_executor``; ``read_units`` runs in the Ray Data read tasks on
the feeder's node. See docs/data.md.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from functools import partial
from typing import Any

import numpy as np
import ray

from elastic.ingest.feeder_reads import Fetched, Read, fetch
from elastic.ingest.feeder_window import FeederWindow
from elastic.ingest.shard_format import parse_footer
from storage import open_storage

log = logging.getLogger(__name__)

SEGMENT_READS = 256  # reads per Ray Data executor: building one costs about 1 ms per read


class RayDataEngine(FeederWindow):
    """The executor loop and the permits (the feeder's own state is ``HostFeeder``'s)."""

    max_reads: int
    storage_options: dict[str, Any]
    timeout_s: float
    stats: dict[str, Any]
    _stop: bool
    _epoch: str | None
    _error: BaseException | None

    def _read_now(self) -> Read | None:
        raise NotImplementedError

    def _gets_in_flight(self) -> int:
        raise NotImplementedError

    def _count_read(self, gets: int, done: Fetched) -> None:
        raise NotImplementedError

    def _store(self, read: Read, done: Fetched, meta: Any) -> None:
        raise NotImplementedError

    def _failed(self, read: Read, exc: BaseException) -> None:
        raise NotImplementedError

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
                rebuild = it is None or spent or self._x_seq != self._seq
                # A jump: the old executor's permitted reads may still be doing their GETs;
                # they are taken (and dropped) before a new executor may read, so this host
                # never has more than ``max_reads`` GETs in flight. Its unpermitted tasks get
                # no permit and return at once.
                if rebuild and not (it is not None and not spent and self._x_reads):
                    self._x = x = self._x + 1
                    self._x_seq, self._x_reads, self._x_next = self._seq, {}, 0
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
                    if self._x_seq == self._seq:
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
            current = read is not None and self._x_seq == self._seq
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
            if self._x_seq == self._seq:
                self._store(read, Fetched(got, *nbytes), meta)

    def permit(self, x: int, pos: int, timeout_s: float) -> Read | None | bool:
        """Asked by a read task of executor ``x`` before its read number ``pos``: the ``Read``
        once it may do it; None if that executor ended (the task returns without reading);
        False after ``timeout_s`` (ask again)."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while True:
                if self._stop or x != self._x or self._x_seq != self._seq:
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


def task_options(max_reads: int) -> dict[str, Any]:
    """Ray Data settings of a feeder's pipelines: in order, no progress output, read tasks on
    this node with no CPU, at most ``max_reads`` at once."""
    import ray.data
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    return {"compute": ray.data.TaskPoolStrategy(size=max_reads), "num_cpus": 0, "scheduling_strategy": here}


def build_executor(
    x: int, max_reads: int, storage_options: dict[str, Any], timeout_s: float
) -> Iterator[dict[str, np.ndarray]]:
    """Executor ``x`` of the calling feeder actor: its reads ``0 .. SEGMENT_READS - 1`` done in
    order by tasks that wait for a permit before each GET (``HostFeeder.permit``)."""
    import ray.data

    opts = task_options(max_reads)
    me = ray.get_runtime_context().current_actor
    items = ray.data.from_items([{"pos": p} for p in range(SEGMENT_READS)], override_num_blocks=SEGMENT_READS)
    read = partial(read_units, feeder=me, x=x, storage_options=storage_options, timeout_s=timeout_s)
    ds = items.map_batches(
        read,
        batch_size=1,
        batch_format="numpy",
        **opts,
    )
    return iter(ds.iter_batches(batch_size=1, batch_format="numpy", prefetch_batches=0))


def close_executor(it: Iterator[Any] | None) -> None:
    """Shut a Ray Data iterator's executor down (closing its generator does)."""
    close = getattr(it, "close", None)
    if close is not None:
        try:
            close()
        except Exception as exc:  # noqa: BLE001 - an executor already failed or gone
            log.debug("closing a Ray Data iterator: %s", exc)


# Per read-task process: the fsspec filesystem for each set of storage options, so a task
# that does many reads opens its connection once.
_FS: dict[str, Any] = {}

_SKIP = {
    "pos": np.asarray([-1]),
    "tokens": np.zeros((1, 1, 1), dtype=np.int32),
    "footer": np.zeros((1, 1), np.uint8),
    "data_bytes": np.asarray([0], dtype=np.int64),
    "meta_bytes": np.asarray([0], dtype=np.int64),
}


def read_units(
    batch: dict[str, np.ndarray], feeder: Any, x: int, storage_options: dict[str, Any], timeout_s: float
) -> dict[str, np.ndarray]:
    """Ray Data map stage of engine ``ray_data``: read number ``pos`` of executor ``x`` -> its
    rows (or a footer's bytes), once the feeder permits it; an ended executor's -> a skip mark."""
    (pos,) = (int(p) for p in batch["pos"])
    while True:
        grant = ray.get(feeder.permit.remote(x, pos, timeout_s), timeout=timeout_s + 30)
        if grant is not False:
            break
    if grant is None:
        return dict(_SKIP, gets=np.asarray([-1]))
    key = repr(sorted(storage_options.items()))
    if key not in _FS:
        _FS[key] = open_storage(grant.uri, storage_options).fs
    done = fetch(_FS[key], grant)
    out = dict(
        _SKIP,
        pos=np.asarray([pos]),
        gets=np.asarray([grant.gets]),
        data_bytes=np.asarray([done.data_bytes], dtype=np.int64),
        meta_bytes=np.asarray([done.meta_bytes], dtype=np.int64),
    )
    if isinstance(done.got, bytes):
        out["footer"] = np.frombuffer(done.got, dtype=np.uint8)[None]
    else:
        out["tokens"] = done.got[None]
    return out
