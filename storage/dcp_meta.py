"""DCP metadata as plain JSON, and its conversion to torch's ``Metadata``.

Stock DCP stores its metadata as a pickle (``.metadata``); unpickling a file from shared
storage can run arbitrary code, so our reader never does. The committer merges the ranks'
:class:`~storage.records.RankWriteResult` into ``metadata.json``::

    {"format": "elastic-dcp-json/1", "dcp_version": "1.0.0", "step": 30, "ranks": [0, 1],
     "tensors": {"model.w": {"dtype": "float32", "size": [64, 32], "chunks": [
         {"offsets": [0, 0], "sizes": [16, 32], "file": "__0_0.distcp", "offset": 0,
          "length": 3625, "crc32": 123}, ...]}},
     "objects": {"step": {"file": "__0_objects.json", "crc32": 456}}}

and the reader rebuilds torch ``Metadata`` from it, so DCP's resharding planner works as usual.
The stock pickle is written too (only for stock tools such as ``dcp_to_torch_save``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from storage.codec import dtype_from_name
from storage.errors import IncompleteCheckpoint
from storage.records import ChunkRecord, RankWriteResult

FORMAT = "elastic-dcp-json/1"
DCP_VERSION = "1.0.0"


def merge_results(step: int, results: Iterable[RankWriteResult]) -> dict[str, Any]:
    """One metadata document from all ranks' results; refuses anything that is not whole.

    Identical boxes written by several ranks (replicas that were not deduplicated) are kept
    once, from the lowest rank. Overlapping boxes, conflicting shapes/dtypes/objects, or boxes
    that do not cover a tensor (a lost rank result) raise :class:`IncompleteCheckpoint`.
    """
    results = sorted(results, key=lambda r: r.rank)
    tensors: dict[str, dict[str, Any]] = {}
    objects: dict[str, dict[str, Any]] = {}
    for res in results:
        if res.step != step:
            raise IncompleteCheckpoint(f"rank {res.rank} wrote step {res.step}, not {step}")
        for c in res.chunks:
            _add_chunk(tensors, c, res.rank)
        for o in res.objects:
            seen = objects.get(o.fqn)
            if seen is None:
                objects[o.fqn] = {"file": o.file, "crc32": o.crc32}
            elif seen["crc32"] != o.crc32:
                raise IncompleteCheckpoint(
                    f"object {o.fqn!r} differs between writers; give rank-local objects rank-specific names"
                )
    for fqn, t in tensors.items():
        covered = sum(math.prod(c["sizes"]) for c in t["chunks"])
        if covered != math.prod(t["size"]):
            raise IncompleteCheckpoint(
                f"{fqn}: saved boxes cover {covered} of {math.prod(t['size'])} elements (missing rank result?)"
            )
    both = sorted(set(tensors) & set(objects))
    if both:
        raise IncompleteCheckpoint(f"names used for both a tensor and an object: {both}")
    return {
        "format": FORMAT,
        "dcp_version": DCP_VERSION,
        "step": step,
        "ranks": [r.rank for r in results],
        "tensors": dict(sorted(tensors.items())),
        "objects": dict(sorted(objects.items())),
    }


def _add_chunk(tensors: dict[str, dict[str, Any]], c: ChunkRecord, rank: int) -> None:
    t = tensors.setdefault(c.fqn, {"dtype": c.dtype, "size": list(c.global_shape), "chunks": []})
    if t["dtype"] != c.dtype or t["size"] != list(c.global_shape):
        raise IncompleteCheckpoint(
            f"{c.fqn}: rank {rank} has {c.dtype}{list(c.global_shape)}, others {t['dtype']}{t['size']}"
        )
    for other in t["chunks"]:
        if other["offsets"] == list(c.offsets) and other["sizes"] == list(c.sizes):
            return  # a replica of a box already written by a lower rank
        if boxes_overlap(other["offsets"], other["sizes"], c.offsets, c.sizes):
            raise IncompleteCheckpoint(
                f"{c.fqn}: box {list(c.offsets)}+{list(c.sizes)} from rank {rank} overlaps another box"
            )
    t["chunks"].append(
        {
            "offsets": list(c.offsets),
            "sizes": list(c.sizes),
            "file": c.file,
            "offset": c.offset,
            "length": c.length,
            "crc32": c.crc32,
        }
    )


def boxes_overlap(off_a, size_a, off_b, size_b) -> bool:
    if math.prod(size_a) == 0 or math.prod(size_b) == 0:
        return False
    return all(a < b + sb and b < a + sa for a, sa, b, sb in zip(off_a, size_a, off_b, size_b))


def to_torch_metadata(tensors: dict[str, dict[str, Any]]) -> tuple[Metadata, dict[MetadataIndex, dict[str, Any]]]:
    """torch ``Metadata`` (tensors only) plus ``{MetadataIndex: chunk dict}`` for the reader."""
    state: dict[str, Any] = {}
    where: dict[MetadataIndex, dict[str, Any]] = {}
    for fqn, t in tensors.items():
        chunks = [ChunkStorageMetadata(torch.Size(c["offsets"]), torch.Size(c["sizes"])) for c in t["chunks"]]
        state[fqn] = TensorStorageMetadata(
            TensorProperties(dtype=dtype_from_name(t["dtype"])), torch.Size(t["size"]), chunks
        )
        for c in t["chunks"]:
            where[MetadataIndex(fqn, c["offsets"])] = c
    metadata = Metadata(
        state_dict_metadata=state,
        planner_data={fqn: (fqn,) for fqn in state},
        storage_meta=StorageMeta(),
        version=DCP_VERSION,
    )
    return metadata, where


def stock_metadata(doc: dict[str, Any]) -> Metadata:
    """The pickled ``.metadata`` stock ``FileSystemReader`` expects (tensors only)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    metadata, where = to_torch_metadata(doc["tensors"])
    metadata.storage_data = {idx: _StorageInfo(c["file"], c["offset"], c["length"]) for idx, c in where.items()}
    return metadata
