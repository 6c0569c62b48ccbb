"""DCP load planner that also accepts :class:`~storage.records.ShardRecord` targets.

DCP's ``DefaultLoadPlanner`` reshards into plain tensors and DTensors. A rank that wants "my
box of the new layout" without building a DTensor (no process group yet, e.g. while a resize
is being planned) passes a ShardRecord instead. Planning also checks that the saved boxes
fully cover every target box: a hole would otherwise leave uninitialised memory behind.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, LoadPlan, Metadata
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.tensor import DTensor

from storage.errors import IncompleteCheckpoint, LayoutMismatch
from storage.records import ShardRecord


class ReshardPlanner(DefaultLoadPlanner):
    """Flat ``{fqn: Tensor | DTensor | ShardRecord}`` targets; no nested-dict flattening."""

    def __init__(self, strict: bool = True):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False, allow_partial_load=not strict)
        self.strict = strict

    def set_up_planner(
        self, state_dict: dict[str, Any], metadata: Metadata | None = None, is_coordinator: bool = False
    ) -> None:
        self.original_state_dict = self.state_dict = state_dict
        self.mappings = {}
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> LoadPlan:
        metadata = self.metadata
        if metadata is None:
            raise RuntimeError("ReshardPlanner: set_up_planner was given no checkpoint metadata")
        items = []
        for fqn, target in self.state_dict.items():
            md = metadata.state_dict_metadata.get(fqn)
            if md is None:
                if self.strict:
                    raise LayoutMismatch(f"{fqn}: not in the checkpoint")
                continue
            if not isinstance(md, TensorStorageMetadata):
                raise LayoutMismatch(f"{fqn}: saved as an object, not a tensor")
            boxes = self._target_boxes(fqn, target, md)
            reads = create_read_items_for_chunk_list(fqn, md, boxes)
            wanted = sum(math.prod(b.sizes) for b in boxes)
            got = sum(math.prod(r.lengths) for r in reads)
            if got != wanted:
                raise IncompleteCheckpoint(f"{fqn}: source holds {got} of the {wanted} elements this target needs")
            items.extend(reads)
        return LoadPlan(items)

    @staticmethod
    def _target_boxes(fqn: str, target: Any, md: TensorStorageMetadata) -> list[ChunkStorageMetadata]:
        if isinstance(target, ShardRecord):
            shape, boxes = (
                target.global_shape,
                [ChunkStorageMetadata(torch.Size(target.offsets), torch.Size(target.sizes))],
            )
        elif isinstance(target, DTensor):
            if target.device_mesh.get_coordinate() is None:
                return []
            shape, boxes = tuple(target.shape), target.__create_chunk_list__()
        elif isinstance(target, torch.Tensor):
            shape = tuple(target.shape)
            boxes = [ChunkStorageMetadata(torch.Size([0] * target.dim()), target.shape)]
        else:
            raise TypeError(f"{fqn}: load targets are Tensor, DTensor or ShardRecord, not {type(target).__name__}")
        if tuple(shape) != tuple(md.size):
            raise LayoutMismatch(f"{fqn}: target shape {tuple(shape)} != saved {tuple(md.size)}")
        return boxes

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        target = self.state_dict[index.fqn]
        if isinstance(target, ShardRecord):
            return target.local
        return super().lookup_tensor(index)
