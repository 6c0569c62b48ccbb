"""Plain-data records passed between the snapshot, the writers and the committer.

A *snapshot* is a flat ``dict[fqn, value]`` taken on one rank, where value is

- a ``torch.Tensor`` holding the whole tensor (replicated state: DDP params, AdamW ``step``);
- a :class:`ShardRecord`: this rank's box of a bigger tensor (FSDP / TP DTensor shards);
- plain data (int/float/str/None/list/tuple/dict, possibly with small tensors inside such as
  RNG states), stored as JSON (see :mod:`storage.codec`).

Everything a rank reports after writing (:class:`RankWriteResult`) is plain, picklable data
so it can travel through Ray or a queue to whichever process commits.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from storage.manifest import FileRecord


@dataclass
class ShardRecord:
    """A box of a global tensor: ``local`` covers ``[offsets, offsets + local.shape)``.

    Used both ways: as a snapshot value to save, and as a load target whose ``local`` is filled
    in place (this is how a rank asks for "my new shard" without a DTensor or process group).
    """

    local: torch.Tensor
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]

    def __post_init__(self) -> None:
        self.global_shape = tuple(int(s) for s in self.global_shape)
        self.offsets = tuple(int(o) for o in self.offsets)
        if not (len(self.global_shape) == len(self.offsets) == self.local.dim()):
            raise ValueError(
                f"rank mismatch: local {tuple(self.local.shape)}, global {self.global_shape}, offsets {self.offsets}"
            )
        for off, size, full in zip(self.offsets, self.local.shape, self.global_shape):
            if off < 0 or off + size > full:
                raise ValueError(
                    f"shard at {self.offsets} of size {tuple(self.local.shape)} exceeds {self.global_shape}"
                )

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(self.local.shape)

    @classmethod
    def empty(cls, global_shape, offsets, sizes, dtype: torch.dtype = torch.float32) -> ShardRecord:
        """An uninitialised load target for the box ``offsets``/``sizes``."""
        return cls(torch.empty(tuple(sizes), dtype=dtype), tuple(global_shape), tuple(offsets))

    @classmethod
    def from_dtensor(cls, dtensor: Any) -> ShardRecord:
        """This rank's box of a DTensor, computed locally (no collective).

        ``local`` aliases ``dtensor.to_local()``: copy it to CPU before the training step
        mutates it. Raises for ``Partial`` placements, which have no box to save.
        """
        from torch.distributed.tensor import Partial
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        if any(isinstance(p, Partial) for p in dtensor.placements):
            raise ValueError("cannot checkpoint a Partial DTensor; redistribute it first")
        sizes, offsets = compute_local_shape_and_global_offset(dtensor.shape, dtensor.device_mesh, dtensor.placements)
        local = dtensor.to_local()
        if tuple(local.shape) != tuple(sizes):  # uneven padding: keep the box, drop the pad
            local = local[tuple(slice(0, s) for s in sizes)]
        return cls(local, tuple(dtensor.shape), tuple(offsets))


def primary_replica(dtensor: Any) -> bool:
    """True on exactly one rank among the replicas of this rank's box.

    Use it as the ``owns`` predicate input so that a tensor replicated over some mesh
    dimensions (DP replicas, or a replicated bias under TP) is written by one rank only.
    """
    from torch.distributed.tensor import Replicate

    coord = dtensor.device_mesh.get_coordinate()
    if coord is None:
        return False
    return all(c == 0 for c, p in zip(coord, dtensor.placements) if isinstance(p, Replicate))


def cpu_snapshot(
    state: Mapping[str, Any], rank: int, *, rank_local: Iterable[str] = ()
) -> tuple[dict[str, Any], frozenset[str]]:
    """CPU copy of a flat state dict in snapshot form, and the fqns this rank should write.

    DTensor -> :class:`ShardRecord` (written by its primary replica only), Tensor -> Tensor
    copy, anything else -> deep copy. Replicated tensors and objects are written by rank 0,
    except the fqns in ``rank_local`` (say ``f"rng.rank{rank}"``), which are written by this
    rank: give per-rank state per-rank names, the commit refuses two different values under
    one name. Pass the second value as ``owns=owned.__contains__`` to ``write_rank_shard``.
    """
    from torch.distributed.tensor import DTensor

    local_names = set(rank_local)
    snapshot: dict[str, Any] = {}
    owned = set()
    for fqn, value in state.items():
        if isinstance(value, DTensor):
            rec = ShardRecord.from_dtensor(value)
            snapshot[fqn] = ShardRecord(rec.local.detach().to("cpu", copy=True), rec.global_shape, rec.offsets)
            mine = primary_replica(value)
        elif isinstance(value, torch.Tensor):
            snapshot[fqn] = value.detach().to("cpu", copy=True)
            mine = rank == 0
        else:
            snapshot[fqn] = copy.deepcopy(value)
            mine = rank == 0
        if mine or fqn in local_names:
            owned.add(fqn)
    return snapshot, frozenset(owned)


def chunk_boxes(global_shape, parts: int, dim: int = 0) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """``(offsets, sizes)`` of ``parts`` boxes split along ``dim`` like ``torch.chunk``/``Shard``.

    Trailing parts may be empty when ``global_shape[dim] < parts``, as with FSDP2.
    """
    shape = tuple(int(s) for s in global_shape)
    step = -(-shape[dim] // parts) if shape[dim] else 0
    boxes = []
    for i in range(parts):
        start = min(i * step, shape[dim])
        stop = min(start + step, shape[dim])
        offsets = tuple(start if d == dim else 0 for d in range(len(shape)))
        sizes = tuple(stop - start if d == dim else s for d, s in enumerate(shape))
        boxes.append((offsets, sizes))
    return boxes


@dataclass(frozen=True)
class ChunkRecord:
    """Where one saved box lives: ``length`` bytes at ``offset`` in data file ``file``."""

    fqn: str
    dtype: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    offset: int
    length: int
    crc32: int


@dataclass(frozen=True)
class ObjectRecord:
    """A plain-data object stored in ``file`` under its fqn; ``crc32`` of its canonical JSON."""

    fqn: str
    file: str
    crc32: int


@dataclass
class RankWriteResult:
    """What one rank wrote for one checkpoint; input to ``commit_checkpoint``."""

    rank: int
    step: int
    files: list[FileRecord] = field(default_factory=list)
    chunks: list[ChunkRecord] = field(default_factory=list)
    objects: list[ObjectRecord] = field(default_factory=list)
    bytes_written: int = 0
    duration_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RankWriteResult:
        def chunk(c):
            return ChunkRecord(**{**c, **{k: tuple(c[k]) for k in ("global_shape", "offsets", "sizes")}})

        return cls(
            rank=d["rank"],
            step=d["step"],
            files=[FileRecord(**f) for f in d["files"]],
            chunks=[chunk(c) for c in d["chunks"]],
            objects=[ObjectRecord(**o) for o in d["objects"]],
            bytes_written=d["bytes_written"],
            duration_s=d["duration_s"],
        )
