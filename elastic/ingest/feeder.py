"""One reader per host: the ``HostFeeder`` actor and the rank-side stream it feeds.

The global sample order is ``elastic.data``'s: row ``i`` of the corpus in index order,
epochs wrapping. A feeder reads that stream shard by shard (one GET per shard, verified
against the index's sha256), from the shard holding its first row, a bounded number of
shards ahead, and serves any contiguous range of rows from memory. Every rank of a model
replica asks the feeder on its replica leader's host, so a TP or PP group reads storage
once; replicas whose leaders share a host share one read. The feeder holds no CPU of the
training workers (``num_cpus=0``); ranks on other hosts receive batches through Ray's
object store. Staggering (``waves``) and the per-host read cap are applied here.
"""

from __future__ import annotations

import io
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import ray

from elastic.ingest.index import read_index, sha256
from elastic.ingest.rounds import wave_of
from elastic.ingest.waves import gate as get_gate
from storage import open_storage

log = logging.getLogger(__name__)


@ray.remote(num_cpus=0, max_concurrency=32)
class HostFeeder:
    def __init__(
        self,
        root: str,
        storage_options: dict[str, Any],
        start_row: int,
        rows_ahead: int,
        max_reads: int,
        gate_name: str | None,
        host_index: int,
        hosts: int,
        waves: int,
        timeout_s: float,
        engine: str = "threads",
    ):
        self.root, self.storage_options, self.engine = root, storage_options, engine
        self._window_busy = False  # engine "ray_data": a Ray Data pipeline is reading a window
        self.fs = open_storage(root, storage_options).fs
        self.index = None  # read after this host's wave opens: the index is a read too
        self.wave = wave_of(host_index, hosts, waves)
        self.rows_ahead, self.start_row = rows_ahead, start_row
        self.max_reads, self.timeout_s = max_reads, timeout_s
        self.host_index = host_index
        self._gate = get_gate(gate_name, hosts, waves) if gate_name and waves > 1 else None
        self._lock = threading.Condition()
        self._units: dict[int, np.ndarray] = {}
        self._inflight: set[int] = set()
        self._low: dict[Any, int] = {}
        self._low_default = start_row
        self._error: BaseException | None = None
        self._stop = False
        self.stats = {"gets": 0, "bytes_read": 0, "wave": self.wave, "gate_wait_s": 0.0, "first_read_at": None}
        self._pool = ThreadPoolExecutor(max_workers=max(1, max_reads), thread_name_prefix="feeder-read")
        threading.Thread(target=self._schedule, daemon=True).start()

    def _open_index(self) -> None:
        index = read_index(self.root, self.storage_options)
        if index is None:
            raise FileNotFoundError(f"{self.root} has no index.json: not a prepared corpus")
        with self._lock:
            self.index, self.n, self.total, self.starts = index, len(index.shards), index.num_rows, index.starts
            self.stats["gets"] += 1
            # Shards ahead of the oldest row still wanted: enough for ``rows_ahead`` rows, plus one
            # per wave: later waves read further ahead, so their steady-state reads stay apart too.
            smallest = min(s.rows for s in index.shards)
            self.lookahead = -(-self.rows_ahead // smallest) + 1 + self.wave
            self._next_unit = self._unit_of(self.start_row)
            self._lock.notify_all()

    # ------------------------------------------------------------------ global row <-> shard
    def _unit_of(self, row: int) -> int:
        epoch, r = divmod(row, self.total)
        return epoch * self.n + int(np.searchsorted(self.starts, r, side="right") - 1)

    def _unit_start(self, k: int) -> int:
        return (k // self.n) * self.total + int(self.starts[k % self.n])

    # ------------------------------------------------------------------ reading
    def _low_unit(self) -> int:
        low = min(self._low.values()) if self._low else self._low_default
        return self._unit_of(low)

    def _schedule(self) -> None:
        """Start reads in order, at most ``max_reads`` in flight, up to ``lookahead`` shards ahead."""
        if self._gate is not None:
            t0 = time.perf_counter()
            try:
                ray.get(self._gate.wait_turn.remote(self.wave), timeout=self.timeout_s)
            except Exception as exc:  # noqa: BLE001 - a dead or slow earlier wave must not stop this one
                log.warning("wave gate: %s; reading anyway", type(exc).__name__)
            self.stats["gate_wait_s"] = time.perf_counter() - t0
        self.stats["first_read_at"] = time.time()
        try:
            self._open_index()
        except BaseException as exc:  # surfaced to every caller of rows()
            with self._lock:
                self._error = exc
                self._lock.notify_all()
            return
        first_fill = self._next_unit + self.lookahead
        reported = self._gate is None
        self._first_fill = first_fill
        with self._lock:
            while not self._stop and self._error is None:
                if not reported and all(k in self._units for k in range(first_fill - self.lookahead, first_fill)):
                    self._gate.done.remote(self.host_index)
                    reported = True
                low = self._low_unit()
                for k in [k for k in self._units if k < low]:
                    del self._units[k]
                if self.engine == "ray_data":
                    if not self._window_busy and self._next_unit < low + self.lookahead:
                        window = list(range(self._next_unit, low + self.lookahead))
                        self._next_unit = window[-1] + 1
                        self._inflight.update(window)
                        self._window_busy = True
                        threading.Thread(target=self._read_window, args=(window,), daemon=True).start()
                        continue
                elif len(self._inflight) < self.max_reads and self._next_unit < low + self.lookahead:
                    k = self._next_unit
                    self._next_unit += 1
                    self._inflight.add(k)
                    self._pool.submit(self._read, k)
                    continue
                self._lock.wait(timeout=1.0)

    def _read(self, k: int) -> None:
        shard = self.index.shards[k % self.n]
        try:
            data = self.fs.cat_file(self.index.uri(shard))  # one GET
            rows = _decode_shard(data, shard.sha256, shard.path)
            with self._lock:
                self.stats["gets"] += 1
                self.stats["bytes_read"] += len(data)
                self._units[k] = rows
        except BaseException as exc:  # surfaced to every caller of rows()
            with self._lock:
                self._error = exc
        finally:
            with self._lock:
                self._inflight.discard(k)
                self._lock.notify_all()

    def _read_window(self, window: list[int]) -> None:
        """Engine ``ray_data``: read shards ``window`` (in order) as a Ray Data pipeline whose
        read tasks run on this node with no CPU, at most ``max_reads`` at once."""
        import ray.data
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        try:
            ctx = ray.data.DataContext.get_current()
            ctx.execution_options.preserve_order = True
            ctx.enable_progress_bars = False
            files = {
                k: (self.index.uri(self.index.shards[k % self.n]), self.index.shards[k % self.n].sha256) for k in window
            }
            here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
            ds = ray.data.from_items([{"unit": k} for k in window], override_num_blocks=len(window)).map_batches(
                _read_units,
                fn_kwargs={"files": files, "storage_options": self.storage_options},
                batch_size=1,
                batch_format="numpy",
                compute=ray.data.TaskPoolStrategy(size=self.max_reads),
                num_cpus=0,
                scheduling_strategy=here,
            )
            for batch in ds.iter_batches(batch_size=1, batch_format="numpy", prefetch_batches=0):
                k, rows = int(batch["unit"][0]), np.asarray(batch["tokens"][0], dtype=np.int32)
                with self._lock:
                    self.stats["gets"] += 1
                    self.stats["bytes_read"] += int(batch["nbytes"][0])
                    self._units[k] = rows
                    self._inflight.discard(k)
                    self._lock.notify_all()
        except BaseException as exc:  # surfaced to every caller of rows()
            with self._lock:
                self._error = exc
        finally:
            with self._lock:
                self._window_busy = False
                self._inflight.difference_update(window)
                self._lock.notify_all()

    # ------------------------------------------------------------------ serving
    def rows(self, start: int, count: int, key: Any = None) -> np.ndarray:
        """Global rows ``[start, start + count)`` as int64 ``[count, seq_len + 1]``."""
        deadline = time.monotonic() + self.timeout_s
        parts = []
        with self._lock:
            self._low[key] = start
            self._lock.notify_all()
            while self.index is None:
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

    def ready(self) -> bool:
        """Block until this host's first window is read (its wave's turn came and went)."""
        deadline = time.monotonic() + self.timeout_s
        with self._lock:
            while True:
                if self._error is not None:
                    raise RuntimeError(f"data feeder read failed: {self._error}") from self._error
                first = getattr(self, "_first_fill", None)
                if first is not None and all(k in self._units for k in range(first - self.lookahead, first)):
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"data feeder: the first reads did not finish within {self.timeout_s:g}s")
                self._lock.wait(timeout=left)

    def get_stats(self) -> dict[str, Any]:
        with self._lock:
            return dict(self.stats, cached_units=len(self._units))

    def close(self) -> None:
        with self._lock:
            self._stop = True
            self._lock.notify_all()
        self._pool.shutdown(wait=False, cancel_futures=True)


def _decode_shard(data: bytes, digest: str, name: str) -> np.ndarray:
    """A shard's bytes, verified against the index's sha256, as int32 rows."""
    if sha256(data) != digest:
        raise OSError(f"{name}: checksum mismatch (damaged or replaced shard)")
    col = pq.read_table(io.BytesIO(data), columns=["tokens"]).column("tokens").combine_chunks()
    return col.flatten().to_numpy().astype(np.int32, copy=False).reshape(len(col), -1)


_FS: dict[str, Any] = {}  # per read-task process: fsspec filesystem by options


def _read_units(batch: dict[str, np.ndarray], files: dict[int, tuple[str, str]], storage_options: dict[str, Any]):
    """Ray Data map stage of engine ``ray_data``: shard numbers -> their rows (one GET each)."""
    rows, sizes = [], []
    for k in batch["unit"]:
        uri, digest = files[int(k)]
        key = repr(sorted(storage_options.items()))
        if key not in _FS:
            _FS[key] = open_storage(uri, storage_options).fs
        data = _FS[key].cat_file(uri)
        rows.append(_decode_shard(data, digest, uri.rsplit("/", 1)[-1]))
        sizes.append(len(data))
    return {"unit": batch["unit"], "tokens": np.stack(rows), "nbytes": np.asarray(sizes, dtype=np.int64)}


def open_feeder(
    plan: dict[str, Any], uri: str, data_cfg: Any, global_batch: int, start_row: int, timeout_s: float, gen: int = 0
):
    """This rank's feeder: the named actor on its replica leader's host. A rank on that host
    creates it (so its owner shares its fate with the host); ranks elsewhere look it up.
    ``gen`` counts the streams opened in this layout (a rollback reopens one)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    name = f"elastic-feeder-{plan['epoch']}-{gen}-{plan['feeder_node'][:16]}"
    if ray.get_runtime_context().get_node_id() != plan["feeder_node"]:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return ray.get_actor(name)
            except ValueError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the data feeder {name} did not appear within {timeout_s:g}s") from None
                time.sleep(0.05)
    return HostFeeder.options(
        name=name,
        get_if_exists=True,
        scheduling_strategy=NodeAffinitySchedulingStrategy(plan["feeder_node"], soft=False),
    ).remote(
        uri,
        data_cfg.storage_options,
        start_row,
        (max(1, data_cfg.prefetch_steps) + 1) * global_batch,
        data_cfg.max_reads_per_host,
        f"elastic-gate-{plan['epoch']}",
        plan["feeder_host"],
        plan["hosts"],
        data_cfg.waves,
        timeout_s * (data_cfg.waves + 1),  # a late wave waits for the earlier ones first
        plan.get("engine", "threads"),
    )


def feeder_batches(feeder, layout: Any, dp_rank: int, start_batch: int, timeout_s: float):
    """``(batch_index, rows)`` for ``dp_rank`` from ``start_batch`` on, in order."""
    b = start_batch
    while True:
        start = b * layout.global_batch + dp_rank * layout.per_rank
        rows = ray.get(feeder.rows.remote(start, layout.per_rank, dp_rank), timeout=timeout_s)
        yield b, rows if rows.flags.writeable else rows.copy()  # object-store arrays are read-only
        b += 1


_INDEXED: dict[tuple[str, str], bool] = {}


def resolve_loader(data_cfg: Any, uri: str) -> str:
    """``data.loader`` resolved for ``uri``: ``ray_data`` or ``feeder`` (a host feeder, its
    reads run as Ray Data tasks or by its own threads) for a prepared corpus (with an
    ``index.json``); ``native``, or ``ray_data_per_rank`` (the per-rank pipeline,
    ``elastic.data``) for any other parquet corpus. ``auto`` is ``feeder`` for a prepared
    corpus and ``native`` otherwise (why not ``ray_data``: docs/data.md). The index is looked up once per driver."""
    if data_cfg.loader == "native":
        return "native"
    key = (uri, repr(sorted(data_cfg.storage_options)))
    if key not in _INDEXED:
        try:
            _INDEXED[key] = read_index(uri, data_cfg.storage_options) is not None
        except Exception as exc:  # noqa: BLE001 - unreadable here: let the native reader report it
            log.warning("data.source index lookup failed (%s)", type(exc).__name__)
            _INDEXED[key] = False
    if data_cfg.loader == "auto":
        return "feeder" if _INDEXED[key] else "native"
    if data_cfg.loader == "ray_data" and not _INDEXED[key]:
        return "ray_data_per_rank"
    return data_cfg.loader


def read_plans(spec: Any, uri: str, node_ids: list[str], generation: int) -> list[dict[str, Any] | None]:
    """Per rank (in rank order): its ``ReadPlan`` as a dict, or None when no feeder is used."""
    loader = resolve_loader(spec.data, uri)
    if loader not in ("feeder", "ray_data"):
        return [None] * len(node_ids)
    import uuid

    from elastic.ingest.waves import read_plans as plans

    epoch = f"{generation}-{uuid.uuid4().hex[:8]}"
    engine = "ray_data" if loader == "ray_data" else "threads"
    return [dict(p.as_dict(), engine=engine) for p in plans(node_ids, spec.parallel.replica_size, epoch)]


class FeederSource:
    """What a rank's trainer reads from: its replica's host feeder (made on first use, and
    again after a rollback). The trainer calls ``open`` and ``close`` and never sees Ray."""

    def __init__(self, plan: dict[str, Any], uri: str, data_cfg: Any, timeout_s: float):
        self.plan, self.uri, self.data_cfg, self.timeout_s = plan, uri, data_cfg, timeout_s
        self.feeder = None
        self._gen = -1

    def open(self, layout: Any, dp_rank: int, start_batch: int):
        """``(batch_index, rows)`` from ``start_batch`` on; returns once this host's first
        window is read (its wave came)."""
        old, self._gen = self.feeder, self._gen + 1
        d = self.data_cfg
        self.feeder = open_feeder(
            self.plan, self.uri, d, layout.global_batch, start_batch * layout.global_batch, self.timeout_s, self._gen
        )
        if old is not None:  # a rollback: the old window may not hold the rows to replay
            ray.kill(old)
        ray.get(self.feeder.ready.remote(), timeout=self.timeout_s * (d.waves + 2))
        return feeder_batches(self.feeder, layout, dp_rank, start_batch, self.timeout_s)

    def close(self) -> None:
        if self.feeder is not None:  # every rank of the layout may end it
            try:
                ray.kill(self.feeder)
            except Exception:  # noqa: BLE001 - already gone with its node
                pass
            self.feeder = None
