"""The driver's and the ranks' side of the host readers (``elastic.ingest.feeder``).

``HostReaders`` (driver) keeps one ``HostFeeder`` per reading host from one layout to the
next and hands each rank a read plan; ``FeederSource`` (rank) begins its layout's stream on
its replica's reader and yields its rows; ``resolve_loader`` picks the loader for a
corpus. See docs/data.md.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

import ray

from elastic.ingest.feeder import HostFeeder
from elastic.ingest.index import read_index
from elastic.ingest.units import StreamRequest, served_slices

log = logging.getLogger(__name__)

# A new feeder's first window may wait this long: its actor, and for engine ray_data the
# processes of its read tasks, start first (tens of seconds on an oversubscribed machine).
COLD_START_S = 90.0


def feeder_batches(feeder, layout: Any, dp_rank: int, start_batch: int, timeout_s: float, epoch: str | None = None):
    """``(batch_index, rows)`` for ``dp_rank`` from ``start_batch`` on, in order. Closed (its
    rank left the layout), it tells the feeder, which then reads no further for it."""
    b = start_batch
    try:
        while True:
            start = b * layout.global_batch + dp_rank * layout.per_rank
            rows = ray.get(feeder.rows.remote(start, layout.per_rank, dp_rank, epoch), timeout=timeout_s)
            yield b, rows if rows.flags.writeable else rows.copy()  # object-store arrays are read-only
            b += 1
    finally:
        try:
            feeder.release.remote(dp_rank, epoch)
        except Exception as exc:  # noqa: BLE001 - the feeder (or Ray) is already gone
            log.debug("release of a feeder stream: %s", exc)


_INDEXED: dict[tuple[str, str], bool] = {}


def resolve_loader(data_cfg: Any, uri: str) -> str:
    """``data.loader`` resolved for ``uri``: ``ray_data`` or ``feeder`` (a host feeder, its
    reads run by one Ray Data executor or by its own threads) for a prepared corpus (with
    an ``index.json``); ``native``, or ``ray_data_per_rank`` (the per-rank pipeline,
    ``elastic.ingest.corpus``) for any other parquet corpus. ``auto`` is ``ray_data`` for a prepared
    corpus of ``tokens`` alone and ``native`` otherwise (docs/data.md). The index is looked up once per driver."""
    if data_cfg.loader == "native":
        return "native"
    key = (uri, repr(sorted(data_cfg.storage_options)))
    if key not in _INDEXED:
        try:
            index = read_index(uri, data_cfg.storage_options)
            _INDEXED[key] = index is not None and index.host_readable  # SFT columns: the rank's reader
        except Exception as exc:  # noqa: BLE001 - unreadable here: let the native reader report it
            log.warning("data.source index lookup failed (%s)", type(exc).__name__)
            _INDEXED[key] = False
    if data_cfg.loader == "auto":
        return "ray_data" if _INDEXED[key] else "native"
    if data_cfg.loader == "ray_data" and not _INDEXED[key]:
        return "ray_data_per_rank"
    return data_cfg.loader


class HostReaders:
    """The driver's feeders: one per reading host (a node holding a replica leader), kept
    from one layout to the next while that host reads, killed when it stops reading and
    at the end of the job. The driver owns them, so a worker's death does not take its
    host's reader with it; a node's loss does."""

    PING_TIMEOUT_S = 5.0
    QUIESCE_S = 10.0  # the longest a reader's GETs in flight are waited for before a new layout

    def __init__(self, spec: Any, uri: str):
        self.spec, self.uri = spec, uri
        self.readers: dict[str, Any] = {}
        self.gate = None
        self._pinned = False
        self._layout: str | None = None  # the epoch of the last plans: the streams a pause ends

    def plans(self, node_ids: list[str], generation: int) -> list[dict[str, Any] | None]:
        """Per rank (in rank order): its read plan as a dict (with its host's reader and the
        wave gate), or None when no feeder is used."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from elastic.ingest.waves import gate as make_gate
        from elastic.ingest.waves import read_plans as plans

        loader = resolve_loader(self.spec.data, self.uri)
        if loader not in ("feeder", "ray_data"):
            return [None] * len(node_ids)
        epoch = self._layout = f"{generation}-{uuid.uuid4().hex[:8]}"
        base = plans(node_ids, self.spec.parallel.replica_size, epoch)
        hosts = {p.feeder_node for p in base}
        alive = self._alive(list(self.readers))
        self._drop([n for n in self.readers if n not in alive])
        self._quiesce(list(self.readers))  # the old layout's reads end before the new one's waves
        self._drop([n for n in self.readers if n not in hosts])
        d, g = self.spec.data, self.spec.train.global_batch
        engine = "ray_data" if loader == "ray_data" else "threads"
        if engine == "ray_data" and not self._pinned:
            _pin_ray_data_actors()
            self._pinned = True
        for node in sorted(hosts - set(self.readers)):
            self.readers[node] = HostFeeder.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)
            ).remote(
                self.uri,
                d.storage_options,
                (max(1, d.prefetch_steps) + 1) * g,  # rows ahead of the slowest rank
                (max(1, d.prefetch_steps) + 2) * g,  # rows kept behind it: a rollback's rows
                d.max_reads_per_host,
                self.spec.elastic.collective_timeout_s,
                engine,
            )
        if self.gate is not None:
            _kill(self.gate)
            self.gate = None
        if d.waves > 1 and len(hosts) > 1:
            self.gate = make_gate(f"elastic-gate-{epoch}", len(hosts), d.waves)
        return [dict(p.as_dict(), engine=engine, reader=self.readers[p.feeder_node], gate=self.gate) for p in base]

    def pause(self) -> None:
        """The layout is over (a peer was lost): every reader starts no further read until
        its next stream begins. Fire and forget: the GETs it already started go on, and the
        next ``plans`` waits for them (``_quiesce``). Without this, the survivors' readers
        would go on filling their windows, side by side, until the new layout's plans, a
        second or more after the loss's detection on a busy driver."""
        for reader in self.readers.values():
            try:
                reader.quiesce.remote(0.0, self._layout)
            except Exception as exc:  # noqa: BLE001 - gone with its node: dropped by the next plans
                log.debug("pause of a data reader failed: %s", exc)

    def _alive(self, nodes: list[str]) -> set[str]:
        refs = {self.readers[n].ping.remote(): n for n in nodes}
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=self.PING_TIMEOUT_S)
        alive = set()
        for ref in ready:
            try:
                ray.get(ref, timeout=0)
                alive.add(refs[ref])
            except Exception:  # noqa: BLE001 - a dead reader is replaced
                pass
        return alive

    def _quiesce(self, nodes: list[str]) -> None:
        """Stop the readers' reads and wait for those in flight (``HostFeeder.quiesce``): a
        new layout's first windows are read in waves from none in flight, so the bound of
        docs/data.md holds at storage after a resize or a recovery too. A reader whose GET
        outlasts ``QUIESCE_S`` is left to finish it, with a warning."""
        refs = {self.readers[n].quiesce.remote(self.QUIESCE_S): n for n in nodes}
        ready, late = ray.wait(list(refs), num_returns=len(refs), timeout=self.QUIESCE_S + self.PING_TIMEOUT_S)
        for ref in ready:
            try:
                left = ray.get(ref, timeout=0)
            except Exception:  # noqa: BLE001 - lost since the ping: replaced with the others
                continue
            if left:
                log.warning("data reader on %s: %d GET(s) in flight after %gs", refs[ref][:8], left, self.QUIESCE_S)
        if late:
            log.warning("data readers did not answer a quiesce within %gs: %d", self.QUIESCE_S, len(late))

    def _drop(self, nodes: list[str]) -> None:
        for n in nodes:
            _kill(self.readers.pop(n))

    def stats(self) -> dict[str, dict[str, Any]]:
        """Each live reader's counters, by node (for benchmarks and tests)."""
        out = {}
        for n, r in self.readers.items():
            try:
                out[n] = ray.get(r.get_stats.remote(), timeout=self.PING_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - gone with its node
                pass
        return out

    def close(self) -> None:
        if self.readers:
            keys = (
                *("gets", "bytes_read", "footer_bytes", "data_bytes", "rows_served"),
                *("streams", "continued", "executors"),
            )
            summary = {n[:8]: {k: st.get(k) for k in keys} for n, st in self.stats().items()}
            log.info("data readers at the end of the job (by node): %s", summary)
        self._drop(list(self.readers))
        if self.gate is not None:
            _kill(self.gate)
            self.gate = None


def _pin_ray_data_actors() -> None:
    """Create Ray Data's per-cluster actors (its stats actor and its autoscaling coordinator)
    from the driver, so they live on the driver's node. Ray Data makes them on the node of
    the first process that runs a pipeline and pins them there; made by a host reader, they
    would be lost with that host, and the coordinator (restarted forever, on a node that is
    gone) would flood every reader's log with retries. Best effort: these are Ray Data
    internals, and a version without them just makes them where it did before."""
    try:
        from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (
            get_or_create_autoscaling_coordinator,
        )
        from ray.data._internal.stats import get_or_create_stats_actor

        get_or_create_stats_actor()
        get_or_create_autoscaling_coordinator()
    except Exception as exc:  # noqa: BLE001 - see above
        log.debug("Ray Data's cluster actors were not pinned to the driver: %s", exc)


def _kill(actor: Any) -> None:
    try:
        ray.kill(actor, no_restart=True)
    except Exception as exc:  # noqa: BLE001 - already gone with its node
        log.debug("kill of a data reader failed: %s", exc)


class FeederSource:
    """What a rank's trainer reads from: its replica's host feeder. Each ``open`` (a new
    layout, or a rollback in one) begins a stream there; the trainer never sees Ray."""

    def __init__(self, plan: dict[str, Any], data_cfg: Any, timeout_s: float):
        self.plan, self.data_cfg, self.timeout_s = plan, data_cfg, timeout_s
        self.feeder = plan["reader"]
        self._gen = -1

    def open(self, layout: Any, dp_rank: int, start_batch: int):
        """``(batch_index, rows)`` from ``start_batch`` on; returns once this host's first
        window is read (its wave came). ``layout.dp`` is the layout's data shards (dp * ep)
        and ``dp_rank`` this rank's (``ParallelDims.data_shard``)."""
        self._gen += 1
        begin = self.feeder.begin.remote(self.request(layout, start_batch), self.plan["gate"])
        ray.get(begin, timeout=COLD_START_S)  # a new feeder's actor may still be starting
        d, epoch = self.data_cfg, f"{self.plan['epoch']}-{self._gen}"
        # A late wave waits for the earlier ones first, and a new feeder starts its processes.
        wait_s = COLD_START_S + self.timeout_s * (d.waves + 2)
        ray.get(self.feeder.ready.remote(epoch, wait_s), timeout=wait_s + self.timeout_s)
        return feeder_batches(self.feeder, layout, dp_rank, start_batch, self.timeout_s, epoch)

    def request(self, layout: Any, start_batch: int) -> StreamRequest:
        """The stream this rank's host reader serves from ``start_batch`` on: the same for every
        rank of the host (the slices of all its replicas), so the first one to ask begins it."""
        p = self.plan
        served = served_slices(p.get("replicas", (0,)), p.get("dp", 1), layout.dp)
        return StreamRequest(
            epoch=f"{p['epoch']}-{self._gen}",
            start_row=start_batch * layout.global_batch,
            global_batch=layout.global_batch,
            shards=layout.dp,
            served=served,
            host_index=p["feeder_host"],
            hosts=p["hosts"],
            waves=self.data_cfg.waves,
        )

    def close(self) -> None:
        """Nothing to release: the reader belongs to the driver and serves the next layout."""
