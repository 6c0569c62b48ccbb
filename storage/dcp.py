"""Sharded checkpoints through torch.distributed.checkpoint: the public entry points.

Write side (per rank, no collectives, fine in a background thread)::

    snapshot, owned = cpu_snapshot(flat_state, rank)          # blocking part: a CPU copy
    res = write_rank_shard(store, step, snapshot, rank, owns=owned.__contains__)
    # ... gather every rank's ``res`` (plain data) to one process, then:
    commit_checkpoint(store, step, results, extra={"dp": 4})

Read side (per rank, no collectives)::

    target = {"w": ShardRecord.empty(shape, offsets, sizes), "b": torch.empty(8), "x": dtensor}
    out = load_into(store, target)                 # newest committed step, resharded
    out = load_into(SnapshotReader(peer_snapshots), target)   # same, from memory
    out.objects["data.cursor"], out.bytes_read
"""

from storage.dcp_planner import ReshardPlanner
from storage.dcp_read import CheckpointReader, LoadResult, SnapshotReader, load_into
from storage.dcp_write import (
    METADATA_JSON,
    STOCK_METADATA,
    commit_checkpoint,
    data_file,
    objects_file,
    write_rank_shard,
)
from storage.records import (
    ChunkRecord,
    ObjectRecord,
    RankWriteResult,
    ShardRecord,
    chunk_boxes,
    cpu_snapshot,
    primary_replica,
)

__all__ = [
    "ShardRecord",
    "RankWriteResult",
    "ChunkRecord",
    "ObjectRecord",
    "chunk_boxes",
    "cpu_snapshot",
    "primary_replica",
    "write_rank_shard",
    "commit_checkpoint",
    "load_into",
    "LoadResult",
    "CheckpointReader",
    "SnapshotReader",
    "ReshardPlanner",
    "METADATA_JSON",
    "STOCK_METADATA",
    "data_file",
    "objects_file",
]
