"""Engine ``ray_data`` of a host feeder: its reads done by one Ray Data streaming executor whose
read tasks wait for the feeder's permit before each GET.

The loop that takes the executor's reads and hands out the permits is the ``HostFeeder``
actor's (``feeder.py``); ``build_executor`` and ``close_executor`` run in that actor, and
``read_units`` in the Ray Data read tasks on the feeder's node. See docs/data.md.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from functools import partial
from typing import Any

import numpy as np
import ray

from elastic.ingest.feeder_reads import fetch
from storage import open_storage

log = logging.getLogger(__name__)

SEGMENT_READS = 256  # reads per Ray Data executor: building one costs about 1 ms per read


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
