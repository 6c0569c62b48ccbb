"""Restoring a worker's state from memory-tier snapshots or from the storage tier."""

from __future__ import annotations

from typing import Any

import torch

from elastic.checkpoint.memory_tier import Snapshot, unflatten_state
from storage.records import ShardRecord

APP = "app"


def load_snapshots_into(engine: Any, snaps: dict[int, Snapshot]) -> None:
    """Load the engine's state from snapshots of the old layout (own or peers').

    Snapshots of fully replicated state (DDP) load directly. Sharded snapshots (FSDP, TP,
    PP, or a different layout) go through DCP's load planner, which reshards them into
    the engine's current layout.
    """
    first = next(iter(snaps.values()))
    sharded = any(isinstance(v, ShardRecord) for s in snaps.values() for v in s.tensors.values())
    if len(snaps) == 1 and not sharded:
        # Clone: the optimizer would otherwise alias the snapshot buffers, which the
        # memory tier reuses for later snapshots.
        flat = {k: v.clone() for k, v in first.tensors.items() if k.startswith(APP + "/")}
        flat.update({k: v for k, v in first.objects.items() if k.startswith(APP + "/")})
        engine.load_state_dict(unflatten_state(flat)[APP])
        return
    _load_resharded(engine, list(snaps.values()))


def _load_resharded(engine: Any, snaps: list[Snapshot]) -> None:
    from storage.dcp import SnapshotReader, load_into

    raise NotImplementedError("resharded restore from memory snapshots")


def load_from_storage(worker: Any, restore: dict[str, Any]) -> dict[str, Any]:
    raise NotImplementedError("restore from the storage tier")


def latest_storage_step(spec: Any, uri: str) -> int | None:
    return None
