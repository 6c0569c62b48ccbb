"""``model.init_from``: load a Hugging Face model directory into a rank's shard of the model.

Runs on every rank, right after the engine is built, at a fresh start (a restore from a
memory snapshot or a checkpoint takes precedence: it holds trained weights). ``HFReader`` is
a torch DCP ``StorageReader`` over the directory's safetensors files, keyed by the project's
parameter names, so the same resharding planner that restores checkpoints
(``storage.load_into``) computes the boxes each rank needs in any layout (DDP, FSDP/ZeRO,
TP, PP and their mixes), and the reader fetches only those byte ranges. The reads follow
``restore.read_staggered``: replicated parameters are read once per DP group and
broadcast, DP-sharded ones by their owner, in ``data.waves`` host rounds.

The rows of rotary projections (``HFAdapter.rotary``) are stored by ``transformers`` as
halves per head; the reader fetches the whole heads that cover a requested row range and
permutes them to interleaved pairs before cutting the box out. An expert tensor
(``HFAdapter.experts``, ``[E, in, out]``) is read from each of its experts' ``[out, in]``
linears, transposed.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from typing import Any

import torch
from torch.distributed.checkpoint import LoadPlan, LoadPlanner, Metadata, StorageReader
from torch.distributed.checkpoint.metadata import (
    STORAGE_TYPES,
    ChunkStorageMetadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.futures import Future

from elastic.checkpoint.safetensors_io import TensorEntry, read_header, read_rows
from elastic.models.hf import INDEX, SINGLE, HFAdapter, expected_names, ignorable, join, open_fs, read_json
from storage import redact_uri

log = logging.getLogger(__name__)


def halves_to_pairs(rows: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Whole heads of rows, Hugging Face layout (halves) -> Meta layout (interleaved pairs)."""
    rest = rows.shape[1:]
    return rows.reshape(-1, 2, head_dim // 2, *rest).transpose(1, 2).reshape(rows.shape)


def pairs_to_halves(rows: torch.Tensor, head_dim: int) -> torch.Tensor:
    """The inverse of ``halves_to_pairs`` (what an export applies)."""
    rest = rows.shape[1:]
    return rows.reshape(-1, head_dim // 2, 2, *rest).transpose(1, 2).reshape(rows.shape)


class HFDirectory:
    """The safetensors files of one Hugging Face model directory; headers read on demand."""

    def __init__(self, uri: str):
        self.uri = uri
        self.fs, self.root = open_fs(uri)
        self.local = "file" in (self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,))
        self.bytes_read = 0
        self._entries: dict[str, dict[str, TensorEntry]] = {}
        if self.fs.exists(join(self.root, INDEX)):
            index = read_json(join(uri, INDEX))
            self.weight_map = {name: join(self.root, file) for name, file in index["weight_map"].items()}
        else:
            files = [join(self.root, SINGLE)] if self.fs.exists(join(self.root, SINGLE)) else []
            files = files or sorted(self.fs.glob(join(self.root, "*.safetensors")))
            self.weight_map = {name: f for f in files for name in self._file(f)}

    def _file(self, path: str) -> dict[str, TensorEntry]:
        if path not in self._entries:
            entries, _, size = read_header(self.fs, path)
            self.bytes_read += size
            self._entries[path] = entries
        return self._entries[path]

    def entry(self, name: str) -> TensorEntry:
        if name not in self.weight_map:
            raise KeyError(f"{name} is not in {redact_uri(self.uri)}")
        return self._file(self.weight_map[name])[name]


class HFReader(StorageReader):
    """DCP ``StorageReader`` of a Hugging Face directory under the project's parameter names."""

    def __init__(self, uri: str, adapter: HFAdapter, fqns: list[str]):
        self.directory = HFDirectory(uri)
        self.adapter = adapter
        self.bytes_read = self.data_bytes_read = 0
        unexpected = sorted(
            n for n in set(self.directory.weight_map) - expected_names(adapter) - adapter.optional if not ignorable(n)
        )
        if unexpected:
            raise ValueError(f"{redact_uri(uri)} holds tensors this model has no place for: {unexpected[:5]}")
        tensors: dict[str, STORAGE_TYPES] = {}
        for fqn in fqns:
            if fqn in adapter.experts:  # E linears [out, in] -> one [E, in, out]
                e = self.directory.entry(adapter.experts[fqn][0])
                shape = (len(adapter.experts[fqn]), *reversed(e.shape))
            elif fqn in adapter.names:
                e = self.directory.entry(adapter.names[fqn])
                shape = e.shape
            else:
                raise ValueError(f"{fqn}: the model's Hugging Face adapter does not name it")
            size = torch.Size(shape)
            tensors[fqn] = TensorStorageMetadata(
                TensorProperties(dtype=e.dtype), size, [ChunkStorageMetadata(torch.Size([0] * len(size)), size)]
            )
        self.metadata = Metadata(state_dict_metadata=tensors)
        self.bytes_read = self.directory.bytes_read  # the index and headers

    # ----- the StorageReader protocol: planned locally, alone (as storage.dcp_read's readers)
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
        return {}

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        before = self.directory.bytes_read
        by_file = defaultdict(list)
        for req in plan.items:
            fqn = req.storage_index.fqn
            first = self.adapter.experts[fqn][0] if fqn in self.adapter.experts else self.adapter.names[fqn]
            by_file[self.directory.weight_map[first]].append(req)
        for _, reqs in sorted(by_file.items()):
            for req in sorted(reqs, key=lambda r: (r.storage_index.fqn, tuple(r.storage_offsets))):
                source = self._read_box(req.storage_index.fqn, list(req.storage_offsets), list(req.lengths))
                target = planner.resolve_tensor(req).detach()
                if target.shape != source.shape:
                    raise ValueError(f"{req.storage_index.fqn}: read {tuple(source.shape)} for {tuple(target.shape)}")
                target.copy_(source)
                planner.commit_tensor(req, target)
        self.bytes_read += self.directory.bytes_read - before  # headers read meanwhile
        fut: Future = Future()
        fut.set_result(None)
        return fut

    def _read_box(self, fqn: str, offsets: list[int], lengths: list[int]) -> torch.Tensor:
        if fqn in self.adapter.experts:
            return self._read_experts(fqn, offsets, lengths)
        entry = self.directory.entry(self.adapter.names[fqn])
        if not entry.shape:
            rows, fetched = read_rows(self.directory.fs, entry, 0, 0, [], self.directory.local)
            self._count(fetched)
            return rows
        lo, hi = offsets[0], offsets[0] + lengths[0]
        head_dim = self.adapter.rotary.get(fqn)
        if head_dim:  # whole heads: the permutation moves rows within a head only
            lo, hi = lo // head_dim * head_dim, -(-hi // head_dim) * head_dim
        inner = list(zip(offsets[1:], lengths[1:]))
        rows, fetched = read_rows(self.directory.fs, entry, lo, hi, inner, self.directory.local)
        self._count(fetched)
        if head_dim:
            rows = halves_to_pairs(rows, head_dim)
        return rows.narrow(0, offsets[0] - lo, lengths[0])

    def _read_experts(self, fqn: str, offsets: list[int], lengths: list[int]) -> torch.Tensor:
        """Box ``[e, a, b]`` of an ``[E, in, out]`` tensor: rows ``b`` (columns ``a``) of each
        expert's ``[out, in]`` linear, transposed."""
        (e0, a0, b0), (ne, na, nb) = offsets, lengths
        parts = []
        for name in self.adapter.experts[fqn][e0 : e0 + ne]:
            entry = self.directory.entry(name)
            rows, fetched = read_rows(self.directory.fs, entry, b0, b0 + nb, [(a0, na)], self.directory.local)
            self._count(fetched)
            parts.append(rows.t())
        return torch.stack(parts)

    def _count(self, fetched: int) -> None:
        self.bytes_read += fetched
        self.data_bytes_read += fetched


def _distinct(tensors: dict[str, Any]) -> dict[str, Any]:
    """The entries of a state dict whose data no earlier entry shares."""
    seen, out = set(), {}
    for fqn, value in tensors.items():
        local = value.to_local() if hasattr(value, "to_local") else value
        key = (local.data_ptr(), tuple(local.shape))
        if key not in seen:
            seen.add(key)
            out[fqn] = value
    return out


def load_init_from(
    engine: Any, uri: str, waves: int = 1, max_reads_per_host: int = 0, host: str | None = None
) -> dict[str, Any]:
    """Load the Hugging Face directory ``uri`` into ``engine``'s model (every rank at once).

    ``waves``, ``max_reads_per_host`` and ``host`` stagger the reads as ``load_from_storage``'s do."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from elastic.checkpoint.restore import read_staggered

    adapter = engine.spec.hf
    if adapter is None:
        raise ValueError(f"model {engine.spec.name!r} has no Hugging Face adapter")
    t0 = time.perf_counter()
    tensors = get_model_state_dict(engine.model)
    reads = _distinct(tensors)  # tied weights (one tensor, two names) are read once
    _, stats = read_staggered(
        engine, reads, lambda: HFReader(uri, adapter, sorted(reads)), waves, max_reads_per_host, host
    )
    set_model_state_dict(engine.model, tensors)
    stats["duration_s"] = time.perf_counter() - t0
    log.info(
        "init_from %s: read %d bytes (%d tensor data), %d bytes by DP broadcast, %.2fs",
        redact_uri(uri),
        stats["bytes_read"],
        stats["data_bytes_read"],
        stats["broadcast_bytes"],
        stats["duration_s"],
    )
    return stats
