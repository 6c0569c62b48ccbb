"""How a host feeder's shards are read: one GET per shard, checked against the index's sha256,
and engine ``ray_data``'s streaming executor whose read tasks wait for the feeder's permit.

``build_executor`` and ``close_executor`` run in the ``HostFeeder`` actor (``feeder.py``);
``read_units`` runs in the Ray Data read tasks on the feeder's node; ``decode_shard`` in both
engines. See docs/data.md.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator
from functools import partial
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import ray

from elastic.ingest.index import sha256
from storage import open_storage

log = logging.getLogger(__name__)

SEGMENT_UNITS = 256  # shards per Ray Data executor: building one costs about 1 ms per shard

# Per read-task process: the fsspec filesystem for each set of storage options, so a task
# that reads many shards opens its connection once.
_FS: dict[str, Any] = {}


def decode_shard(data: bytes, digest: str, name: str) -> np.ndarray:
    """A shard's bytes, verified against the index's sha256, as int32 rows."""
    if sha256(data) != digest:
        raise OSError(f"{name}: checksum mismatch (damaged or replaced shard)")
    col = pq.read_table(io.BytesIO(data), columns=["tokens"]).column("tokens").combine_chunks()
    return col.flatten().to_numpy().astype(np.int32, copy=False).reshape(len(col), -1)


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
    """Executor ``x`` of the calling feeder actor: stream positions ``0 .. SEGMENT_UNITS - 1``
    read in order by tasks that wait for a permit before each read (``HostFeeder.permit``)."""
    import ray.data

    opts = task_options(max_reads)
    me = ray.get_runtime_context().current_actor
    items = ray.data.from_items([{"pos": p} for p in range(SEGMENT_UNITS)], override_num_blocks=SEGMENT_UNITS)
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


def read_units(
    batch: dict[str, np.ndarray], feeder: Any, x: int, storage_options: dict[str, Any], timeout_s: float
) -> dict[str, np.ndarray]:
    """Ray Data map stage of engine ``ray_data``: a stream position -> its shard's rows (one
    GET), once the feeder permits it; an ended executor's position -> a skip mark."""
    (pos,) = (int(p) for p in batch["pos"])
    while True:
        grant = ray.get(feeder.permit.remote(x, pos, timeout_s), timeout=timeout_s + 30)
        if grant is not False:
            break
    if grant is None:
        return {"unit": np.asarray([-1]), "tokens": np.zeros((1, 1, 1), dtype=np.int32), "nbytes": np.asarray([-1])}
    k, uri, digest = grant
    key = repr(sorted(storage_options.items()))
    if key not in _FS:
        _FS[key] = open_storage(uri, storage_options).fs
    data = _FS[key].cat_file(uri)
    rows = decode_shard(data, digest, uri.rsplit("/", 1)[-1])
    return {"unit": np.asarray([k]), "tokens": rows[None], "nbytes": np.asarray([len(data)], dtype=np.int64)}
