"""Collective-free upload of one rank's snapshot, and the commit that merges all ranks.

The runtime snapshots state to CPU memory, then uploads it later in a background thread,
when the process group may be gone (a peer died) or busy (training continues). So
:func:`write_rank_shard` needs no collective: every rank writes ``__{rank}_0.distcp`` in the
stock DCP ``TORCH_SAVE`` layout (one ``torch.save`` per box, back to back) straight into an
fsspec stream, computing each box's crc32 and the file's crc32 as bytes go by. Nothing is
staged on local disk. It returns a plain-data :class:`~storage.records.RankWriteResult`;
whoever gathers all of them calls :func:`commit_checkpoint`.

Why not torch's ``FileSystemWriter``/``FsspecWriter``: they are driven by ``dcp.save``,
whose planning is a collective, and they record no checksums.
"""

from __future__ import annotations

import json
import logging
import pickle
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from storage import codec
from storage.dcp_meta import merge_results, stock_metadata
from storage.manifest import FileRecord, crc32
from storage.records import ChunkRecord, ObjectRecord, RankWriteResult, ShardRecord
from storage.retry import RetryPolicy, call_with_retry
from storage.store import CheckpointInfo, CheckpointStore

log = logging.getLogger(__name__)

METADATA_JSON = "metadata.json"
STOCK_METADATA = ".metadata"


def data_file(rank: int) -> str:
    return f"__{rank}_0.distcp"


def objects_file(rank: int) -> str:
    return f"__{rank}_objects.json"


class _CrcWriter:
    """File-like sink that forwards to a stream and keeps running crc32s and a position.

    ``error`` keeps what the stream raised: ``torch.save`` turns a failed write into its own
    RuntimeError ("unexpected pos"), which hides the cause (a full disk, a read-only mount).
    """

    def __init__(self, stream: Any):
        self.stream = stream
        self.pos = 0
        self.file_crc = 0
        self.item_crc = 0
        self.error: BaseException | None = None

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        try:
            self.stream.write(view)
        except BaseException as exc:
            self.error = exc
            raise
        self.file_crc = crc32(view, self.file_crc)
        self.item_crc = crc32(view, self.item_crc)
        self.pos += view.nbytes
        return view.nbytes

    def flush(self) -> None:
        self.stream.flush()


def write_rank_shard(
    store: CheckpointStore,
    step: int,
    snapshot: Mapping[str, Any],
    rank: int,
    *,
    owns: Callable[[str], bool] | None = None,
    retry: RetryPolicy | None = None,
) -> RankWriteResult:
    """Upload this rank's part of ``snapshot`` for ``step``; no collectives, safe in a thread.

    ``owns(fqn)`` returning False skips an entry, so that replicated state (DDP parameters, a
    TP-sharded tensor on DP replicas > 0, the optimizer step counter) is written by exactly one
    rank. Each file is retried as a whole with ``retry`` (default: the store's policy); when
    storage stays down past the deadline this raises ``StorageUnavailable`` and the
    checkpoint must simply not be committed.
    """
    start = time.monotonic()
    policy = retry or store.retry
    tensors: list[tuple[str, torch.Tensor, tuple[int, ...], tuple[int, ...]]] = []
    objects: dict[str, Any] = {}
    for fqn in sorted(snapshot):
        if owns is not None and not owns(fqn):
            continue
        value = snapshot[fqn]
        if isinstance(value, DTensor):
            value = ShardRecord.from_dtensor(value)
        if isinstance(value, ShardRecord):
            tensors.append((fqn, value.local, value.global_shape, value.offsets))
        elif isinstance(value, torch.Tensor):
            tensors.append((fqn, value, tuple(value.shape), (0,) * value.dim()))
        else:
            objects[fqn] = codec.encode(value, fqn)
    result = RankWriteResult(rank=rank, step=step)
    if tensors:
        name = data_file(rank)
        record, chunks = call_with_retry(lambda: _write_data_file(store, step, name, tensors), policy, f"upload {name}")
        result.files.append(record)
        result.chunks.extend(chunks)
    if objects:
        name = objects_file(rank)
        body = codec.dumps(objects).encode()
        uri = store.file_uri(step, name)
        call_with_retry(lambda: store.storage.put_bytes(uri, body), policy, f"upload {name}")
        result.files.append(FileRecord(name, len(body), crc32(body)))
        result.objects.extend(ObjectRecord(fqn, name, crc32(codec.dumps(v).encode())) for fqn, v in objects.items())
    result.bytes_written = sum(f.size for f in result.files)
    result.duration_s = time.monotonic() - start
    log.debug("rank %d wrote %d bytes for step %d in %.3fs", rank, result.bytes_written, step, result.duration_s)
    return result


def _write_data_file(
    store: CheckpointStore,
    step: int,
    name: str,
    tensors: list[tuple[str, torch.Tensor, tuple[int, ...], tuple[int, ...]]],
) -> tuple[FileRecord, list[ChunkRecord]]:
    chunks = []
    with store.storage.open(store.file_uri(step, name), "wb") as stream:
        sink = _CrcWriter(stream)
        for fqn, tensor, global_shape, offsets in tensors:
            t = _compact(tensor)
            begin, sink.item_crc = sink.pos, 0
            try:
                torch.save(t, sink)
            except RuntimeError:
                if sink.error is not None:  # the stream's own error, not torch's account of it
                    raise sink.error from None
                raise
            chunks.append(
                ChunkRecord(
                    fqn,
                    codec.dtype_name(t.dtype),
                    global_shape,
                    offsets,
                    tuple(t.shape),
                    name,
                    begin,
                    sink.pos - begin,
                    sink.item_crc,
                )
            )
    return FileRecord(name, sink.pos, sink.file_crc), chunks


def _compact(tensor: torch.Tensor) -> torch.Tensor:
    """CPU, contiguous, owning exactly its bytes: torch.save writes whole storages."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if not t.is_contiguous() or t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.clone(memory_format=torch.contiguous_format)
    return t


def commit_checkpoint(
    store: CheckpointStore,
    step: int,
    results: Iterable[RankWriteResult],
    extra: dict[str, Any] | None = None,
    *,
    stock_pickle: bool = True,
) -> CheckpointInfo:
    """Merge the ranks' results, write ``metadata.json`` (+ stock ``.metadata``), manifest, marker.

    Raises ``IncompleteCheckpoint`` (nothing written) when the results do not describe a whole
    checkpoint, and ``StorageUnavailable`` when storage stays down; in both cases the step is
    not committed and a later :meth:`CheckpointStore.prune` removes the leftovers.
    """
    results = list(results)
    doc = merge_results(step, results)
    files = [f for r in results for f in r.files]
    files.append(store.put_file(step, METADATA_JSON, json.dumps(doc, sort_keys=True).encode()))
    if stock_pickle:
        files.append(store.put_file(step, STOCK_METADATA, pickle.dumps(stock_metadata(doc))))
    return store.commit(step, files, extra)
