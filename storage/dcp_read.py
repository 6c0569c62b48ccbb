"""Resharding loads through DCP's planner, from storage or from in-memory snapshots.

Both sources implement torch's ``StorageReader`` over the same picture of the saved state
(boxes of global tensors), so one planner serves both recovery paths:

- :class:`CheckpointReader` reads a committed checkpoint. It fetches only the saved boxes that
  overlap this rank's target boxes (coalesced byte ranges), checks each box's crc32 before
  decoding it with ``torch.load(weights_only=True)``, and counts every byte it fetches.
- :class:`SnapshotReader` serves boxes straight out of rank snapshots held in memory (e.g.
  copies fetched from surviving peers), so in-memory recovery reshards exactly like storage.

:func:`load_into` fills a target state dict of any layout: plain tensors (full), DTensors of
any mesh/placement, or :class:`~storage.records.ShardRecord` boxes. Each rank plans and reads
alone: no collective, no gather to rank 0.
"""

from __future__ import annotations

import io
import json
import math
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint import LoadPlan, LoadPlanner, Metadata, StorageReader
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.tensor import DTensor
from torch.futures import Future

from storage import codec
from storage.dcp_meta import to_torch_metadata
from storage.dcp_planner import ReshardPlanner
from storage.dcp_write import METADATA_JSON
from storage.errors import CheckpointNotFound, ChecksumMismatch, UnsafePath
from storage.manifest import MANIFEST, MARKER, Manifest, Marker, crc32
from storage.records import ShardRecord
from storage.store import CheckpointStore, safe_relpath

_MAX_REQUEST = 64 << 20


class _ReaderBase(StorageReader):
    """The parts of ``StorageReader`` that need no storage: we plan locally, alone."""

    metadata: Metadata
    bytes_read: int = 0  # everything fetched: metadata, objects and tensor data
    data_bytes_read: int = 0  # tensor data only

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self.metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False

    def read_objects(self) -> dict[str, Any]:
        raise NotImplementedError


def _copy_into(planner: LoadPlanner, req: Any, source: torch.Tensor) -> int:
    """Copy the requested hypercube of ``source`` into the planner's target; returns bytes."""
    for dim, (start, length) in enumerate(zip(req.storage_offsets, req.lengths)):
        source = source.narrow(dim, start, length)
    target = planner.resolve_tensor(req).detach()
    if target.shape != source.shape:
        raise ValueError(f"{req.storage_index.fqn}: read {tuple(source.shape)} for a target of {tuple(target.shape)}")
    target.copy_(source)
    planner.commit_tensor(req, target)
    return source.numel() * source.element_size()


def _done() -> Future:
    fut: Future = Future()
    fut.set_result(None)
    return fut


class CheckpointReader(_ReaderBase):
    """Reads committed step ``step`` (default: the newest committed) of ``store``."""

    def __init__(self, store: CheckpointStore, step: int | None = None, *, max_request_bytes: int = _MAX_REQUEST):
        if step is None:
            latest = store.latest()
            if latest is None:
                raise CheckpointNotFound(f"no committed checkpoint under {store!r}")
            step = latest.step
        self.store, self.step, self.max_request_bytes = store, step, max_request_bytes
        self.bytes_read = self.data_bytes_read = 0
        try:
            marker = Marker.from_bytes(self._get(MARKER))
        except (FileNotFoundError, ValueError, KeyError, TypeError):
            marker = None
        if marker is None or marker.step != step:
            raise CheckpointNotFound(f"step {step} is not committed in {store!r}")
        raw = self._get(MANIFEST)
        if crc32(raw) != marker.manifest_crc32:
            raise ChecksumMismatch(MANIFEST, "crc32 does not match the commit marker")
        self.manifest = Manifest.from_bytes(raw)
        self.doc = json.loads(self._get_verified(METADATA_JSON))
        self.metadata, self._where = to_torch_metadata(self.doc["tensors"])
        named = {box["file"] for box in self._where.values()} | {rec["file"] for rec in self.doc["objects"].values()}
        for file in sorted(named, key=str):
            if not safe_relpath(file):
                raise UnsafePath(str(file))
            if file not in self.manifest.files:
                raise ChecksumMismatch(file, f"named by {METADATA_JSON} but not in the manifest")

    def _get(self, relpath: str, start: int | None = None, end: int | None = None) -> bytes:
        data = self.store.get_file(self.step, relpath, start, end)
        self.bytes_read += len(data)
        return data

    def _get_verified(self, relpath: str) -> bytes:
        data, rec = self._get(relpath), self.manifest.files.get(relpath)
        if rec is None or len(data) != rec.size or crc32(data) != rec.crc32:
            raise ChecksumMismatch(relpath, "size or crc32 differs from the manifest")
        return data

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        wanted: dict[MetadataIndex, list[Any]] = defaultdict(list)
        for req in plan.items:
            wanted[req.storage_index].append(req)
        boxes = sorted(wanted, key=lambda idx: (self._where[idx]["file"], self._where[idx]["offset"]))
        for file, start, end, group in self._coalesce(boxes):
            blob = memoryview(self._get(file, start, end))
            self.data_bytes_read += len(blob)
            for idx in group:
                box = self._where[idx]
                part = blob[box["offset"] - start : box["offset"] - start + box["length"]]
                if len(part) != box["length"] or crc32(part) != box["crc32"]:
                    raise ChecksumMismatch(file, f"box {idx.fqn}@{list(idx.offset)} fails its crc32")
                tensor = torch.load(io.BytesIO(part), map_location="cpu", weights_only=True)
                for req in wanted[idx]:
                    _copy_into(planner, req, tensor)
        return _done()

    def _coalesce(self, boxes: list[MetadataIndex]):
        """Group boxes that sit back to back in one file into single range requests."""
        group: list[MetadataIndex] = []
        file, start, end = None, 0, 0
        for idx in boxes:
            box = self._where[idx]
            if (
                group
                and box["file"] == file
                and box["offset"] == end
                and end - start + box["length"] <= self.max_request_bytes
            ):
                group.append(idx)
                end += box["length"]
                continue
            if group:
                yield file, start, end, group
            group, file, start, end = [idx], box["file"], box["offset"], box["offset"] + box["length"]
        if group:
            yield file, start, end, group

    def read_objects(self) -> dict[str, Any]:
        objects: dict[str, Any] = {}
        by_file: dict[str, list[str]] = defaultdict(list)
        for fqn, rec in self.doc["objects"].items():
            by_file[rec["file"]].append(fqn)
        for file, fqns in sorted(by_file.items()):
            body = json.loads(self._get_verified(file))
            objects.update({fqn: codec.decode(body[fqn]) for fqn in fqns})
        return objects


class SnapshotReader(_ReaderBase):
    """``StorageReader`` over rank snapshots in memory (``{rank: snapshot}`` or a list).

    A box held by several ranks is served from ``prefer_rank`` if it has one (the local copy),
    else from the lowest rank. Snapshot values may be "layouts" whose tensors live on the
    ``meta`` device: then :meth:`sources_for` can plan which peers to fetch from before any
    data moves. ``bytes_by_rank`` counts bytes copied out of each source rank's snapshot.
    """

    def __init__(
        self,
        snapshots: Mapping[int, Mapping[str, Any]] | Sequence[Mapping[str, Any]],
        *,
        prefer_rank: int | None = None,
    ):
        snaps = dict(snapshots) if isinstance(snapshots, Mapping) else dict(enumerate(snapshots))
        order = sorted(snaps, key=lambda r: (r != prefer_rank, r))
        tensors: dict[str, dict[str, Any]] = {}
        self._source: dict[MetadataIndex, tuple[int, torch.Tensor]] = {}
        self._objects: dict[str, Any] = {}
        for rank in order:
            for fqn, value in snaps[rank].items():
                box = _as_box(value)
                if box is None:
                    self._objects.setdefault(fqn, value)
                    continue
                t = tensors.setdefault(
                    fqn, {"dtype": codec.dtype_name(box.local.dtype), "size": list(box.global_shape), "chunks": []}
                )
                key = MetadataIndex(fqn, box.offsets)
                if key not in self._source:
                    t["chunks"].append({"offsets": list(box.offsets), "sizes": list(box.sizes)})
                    self._source[key] = (rank, box.local)
        self.metadata, _ = to_torch_metadata(tensors)
        self.bytes_read = self.data_bytes_read = 0
        self.bytes_by_rank: dict[int, int] = defaultdict(int)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        for req in plan.items:
            rank, tensor = self._source[req.storage_index]
            copied = _copy_into(planner, req, tensor)
            self.bytes_read += copied
            self.data_bytes_read += copied
            self.bytes_by_rank[rank] += copied
        return _done()

    def read_objects(self) -> dict[str, Any]:
        return dict(self._objects)

    def sources_for(self, state_dict: Mapping[str, Any], *, strict: bool = True) -> dict[int, int]:
        """``{source rank: bytes}`` this rank would copy to fill ``state_dict``; reads nothing."""
        planner = ReshardPlanner(strict=strict)
        planner.set_up_planner(dict(state_dict), self.metadata, True)
        need: dict[int, int] = defaultdict(int)
        for req in planner.create_local_plan().items:
            rank, tensor = self._source[req.storage_index]
            need[rank] += math.prod(req.lengths) * tensor.element_size()
        return dict(need)


def _as_box(value: Any) -> ShardRecord | None:
    if isinstance(value, ShardRecord):
        return value
    if isinstance(value, DTensor):
        return ShardRecord.from_dtensor(value)
    if isinstance(value, torch.Tensor):
        return ShardRecord(value, tuple(value.shape), (0,) * value.dim())
    return None


@dataclass
class LoadResult:
    """What :func:`load_into` did: the plain-data objects, and the bytes it read."""

    objects: dict[str, Any] = field(default_factory=dict)
    bytes_read: int = 0
    data_bytes_read: int = 0
    duration_s: float = 0.0
    step: int | None = None


def load_into(
    source: CheckpointStore | _ReaderBase, state_dict: dict[str, Any], *, step: int | None = None, strict: bool = True
) -> LoadResult:
    """Fill ``state_dict`` (tensors, DTensors, ShardRecords) in place from ``source``.

    ``source`` is a :class:`CheckpointStore` (``step`` defaults to the newest committed one),
    a :class:`CheckpointReader` or a :class:`SnapshotReader`. This runs the StorageReader /
    LoadPlanner sequence of ``dcp.load`` for a single process (DCP's own ``load`` would warn on
    every call without a process group). With ``strict``, every target key must be saved.
    """
    begin = time.monotonic()
    reader = CheckpointReader(source, step) if isinstance(source, CheckpointStore) else source
    already, already_data = reader.bytes_read, reader.data_bytes_read
    planner = ReshardPlanner(strict=strict)
    metadata = reader.read_metadata()
    planner.set_up_planner(state_dict, metadata, True)
    reader.set_up_storage_reader(metadata, True)
    plan = reader.prepare_local_plan(planner.create_local_plan())
    plan = reader.prepare_global_plan(planner.create_global_plan([plan]))[0]
    reader.read_data(planner.finish_plan(plan), planner).wait()
    objects = reader.read_objects()
    return LoadResult(
        objects=objects,
        bytes_read=reader.bytes_read - already,
        data_bytes_read=reader.data_bytes_read - already_data,
        duration_s=time.monotonic() - begin,
        step=getattr(reader, "step", None),
    )
