"""Fetch only the snapshots a resharding restore needs (worker side).

When the DP degree changes under FSDP, a rank's new shard of each tensor overlaps only some
old ranks' shards (two, typically, for a shrink by one). Every old shard of its (pp, tp)
coordinate is offered (``MemoryRestore.holders``), but the rank first asks each remote
holder for its snapshot's *layout* (each tensor's box, no data: a few kB), plans the load
against its new engine's state with DCP's own planner (``SnapshotReader.sources_for``),
and then fetches the snapshots that hold a part of its shard, nothing else.
"""

from __future__ import annotations

from typing import Any

import torch

from storage import SnapshotReader
from storage.records import ShardRecord


def layout_of(snap: Any) -> dict[str, dict[str, Any]]:
    """A snapshot's tensor boxes without their data (``TrainWorker.snapshot_layout``)."""
    out = {}
    for path, value in snap.tensors.items():
        t = value.local if isinstance(value, ShardRecord) else value
        box = {"dtype": str(t.dtype).removeprefix("torch."), "shape": tuple(t.shape)}
        if isinstance(value, ShardRecord):
            box["global_shape"], box["offsets"] = value.global_shape, value.offsets
        out[path] = box
    return out


def _meta(layout: dict[str, dict[str, Any]]) -> dict[str, Any]:
    boxes: dict[str, Any] = {}
    for path, b in layout.items():
        t = torch.empty(b["shape"], dtype=getattr(torch, b["dtype"]), device="meta")
        boxes[path] = ShardRecord(t, b["global_shape"], b["offsets"]) if "offsets" in b else t
    return boxes


def needed_owners(
    target: dict[str, Any], layouts: dict[int, dict[str, dict[str, Any]]], prefer: int | None
) -> set[int]:
    """The old ranks (keys of ``layouts``) whose snapshots hold a part of ``target`` (the new
    engine's tensors by snapshot path, ``restore.flat_target``); ``prefer``'s own copy first."""
    reader = SnapshotReader({rank: _meta(lay) for rank, lay in layouts.items()}, prefer_rank=prefer)
    return set(reader.sources_for(target))
