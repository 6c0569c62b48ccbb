"""A rank's snapshot of its training state in host memory, and the flat form it is kept in.

Runs in the worker processes (the memory tier's buffers, the restore path) and on the wire
between a rank and its peer (``Snapshot.to_wire``/``from_wire``). A snapshot is a flat
mapping ``fqn -> tensor | ShardRecord | plain value`` (the shape the storage tier writes,
see ``storage.dcp``); the buffers it is copied into are allocated here
(``alloc_like``) and reused while their structure matches (``same_structure``).
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from storage.records import ShardRecord


@dataclass
class Snapshot:
    step: int
    rank: int
    tensors: dict[str, Any]  # fqn -> Tensor | ShardRecord (CPU)
    objects: dict[str, Any]  # plain data: scheduler, data cursor, RNG states, step
    layout: dict[str, int] = field(default_factory=dict)  # dp/tp/pp/zero it was taken under
    complete: bool = False
    leases: int = 0
    copy_s: float = 0.0
    reported: bool = False

    def to_wire(self) -> dict[str, Any]:
        """A form Ray ships without pickling tensors: each tensor as a flat byte array.

        Ray serialises numpy arrays out of band (one copy into its object store) and the
        receiver maps them without copying; pickled tensors would be copied twice more and
        re-allocated on arrival. Byte views keep every dtype (numpy has no bfloat16).
        """
        tensors = {}
        for key, value in self.tensors.items():
            t = value.local if isinstance(value, ShardRecord) else value
            entry = {
                "bytes": t.detach().contiguous().reshape(-1).view(torch.uint8).numpy(),
                "dtype": str(t.dtype).removeprefix("torch."),
                "shape": tuple(t.shape),
            }
            if isinstance(value, ShardRecord):
                entry["global_shape"], entry["offsets"] = value.global_shape, value.offsets
            tensors[key] = entry
        return {
            "step": self.step,
            "rank": self.rank,
            "layout": dict(self.layout),
            "objects": self.objects,
            "tensors": tensors,
        }

    @classmethod
    def from_wire(cls, wire: dict[str, Any]) -> Snapshot:
        """The inverse of :meth:`to_wire`; the tensors are read-only views of the received bytes."""
        tensors: dict[str, Any] = {}
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            for key, e in wire["tensors"].items():
                t = torch.from_numpy(e["bytes"]).view(getattr(torch, e["dtype"])).reshape(e["shape"])
                tensors[key] = ShardRecord(t, e["global_shape"], e["offsets"]) if "offsets" in e else t
        return cls(wire["step"], wire["rank"], tensors, wire["objects"], wire["layout"], complete=True)

    @property
    def nbytes(self) -> int:
        total = 0
        for v in self.tensors.values():
            t = v.local if isinstance(v, ShardRecord) else v
            total += t.numel() * t.element_size()
        return total


SEP = "/"  # path separator: module FQNs already contain dots


def flatten_state(state: dict[str, Any], prefix: str = "") -> tuple[dict[str, Any], dict[str, Any]]:
    """Split a nested state dict into (tensor leaves, plain leaves) keyed by ``a/b/fqn`` paths."""
    from torch.distributed.tensor import DTensor

    tensors: dict[str, Any] = {}
    objects: dict[str, Any] = {}
    for key, value in state.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            t, o = flatten_state(value, path + SEP)
            tensors.update(t)
            objects.update(o)
        elif isinstance(value, DTensor):
            tensors[path] = ShardRecord.from_dtensor(value)
        elif isinstance(value, torch.Tensor) and value.dim() > 0:
            tensors[path] = value
        else:
            objects[path] = value
    return tensors, objects


_ATOMIC = (str, int, float, bool, bytes, type(None))


def copy_plain(value: Any) -> Any:
    """A deep copy of plain data (dicts, lists, tuples, scalars, small tensors).

    ``copy.deepcopy`` keeps a memo of every object it visits, which costs about a
    millisecond per step for the RNG states and optimizer hyperparameters; plain data has
    no shared or cyclic references to preserve, so a direct walk suffices.
    """
    if isinstance(value, _ATOMIC):
        return value
    if isinstance(value, dict):
        return {k: copy_plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [v if type(v) in _ATOMIC else copy_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(v if type(v) in _ATOMIC else copy_plain(v) for v in value)
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    return copy.deepcopy(value)


def unflatten_state(flat: dict[str, Any]) -> dict[str, Any]:
    """The inverse of :func:`flatten_state`'s keys: ``a/b/fqn`` paths back into nested dicts."""
    nested: dict[str, Any] = {}
    for path, value in flat.items():
        node = nested
        *parents, leaf = path.split(SEP)
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return nested


def alloc_like(value: Any, pin: bool) -> Any:
    """An empty CPU buffer (pinned when ``pin``) shaped like a tensor or a ``ShardRecord``'s local shard."""
    if isinstance(value, ShardRecord):
        return ShardRecord(alloc_like(value.local, pin), tuple(value.global_shape), tuple(value.offsets))
    return torch.empty(value.shape, dtype=value.dtype, device="cpu", pin_memory=pin)


def same_structure(buf: dict[str, Any], tensors: dict[str, Any]) -> bool:
    """Whether a snapshot buffer can take ``tensors``: same keys, shards, shapes and dtypes."""
    if buf.keys() != tensors.keys():
        return False
    for k, v in tensors.items():
        old = buf[k]
        if isinstance(old, ShardRecord) != isinstance(v, ShardRecord):
            return False
        if isinstance(v, ShardRecord) and (
            old.global_shape != tuple(v.global_shape) or old.offsets != tuple(v.offsets)
        ):
            return False
        a = old.local if isinstance(old, ShardRecord) else old
        b = v.local if isinstance(v, ShardRecord) else v
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
    return True
