"""Memory tier: per-rank CPU snapshots of the training state, double-buffered.

A snapshot is a flat mapping ``fqn -> tensor | ShardRecord | plain value`` (the shape the
storage tier writes, see ``storage.dcp``). Tensors are copied into preallocated CPU
buffers (pinned on CUDA) that are reused, so steady-state snapshots allocate nothing.

Double buffering: a copy in progress always goes to a buffer that is not the newest
complete snapshot, so a failure during a copy never corrupts the last good one. A buffer
that the storage tier is still uploading is *leased* and is not reused until released;
a third buffer is allocated instead.

The copy runs on a background thread (on CUDA: non-blocking device-to-host copies on a
side stream). The training loop only has to call :meth:`wait` before it next mutates the
state (the optimizer step), so the copy overlaps the next forward/backward.

Peer replicas: a rank can hold copies of other ranks' snapshots (``store_replica``), so a
lost rank's shard can be served by a survivor on another node.
"""

from __future__ import annotations

import copy
import threading
import time
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


def unflatten_state(flat: dict[str, Any]) -> dict[str, Any]:
    nested: dict[str, Any] = {}
    for path, value in flat.items():
        node = nested
        *parents, leaf = path.split(SEP)
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return nested


class MemoryTier:
    def __init__(self, device: str = "cpu"):
        self._pin = device == "cuda" and torch.cuda.is_available()
        self._own: list[Snapshot] = []  # complete or in-progress own snapshots, oldest first
        self._free: list[Snapshot] = []  # buffers available for reuse
        self._replicas: dict[int, dict[int, Snapshot]] = {}  # owner rank -> step -> snapshot
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    # ------------------------------------------------------------------ own snapshots
    def snapshot_async(self, step: int, rank: int, state: dict[str, Any], layout: dict[str, int]) -> float:
        """Start copying ``state`` (``rank``'s, at ``step``) into a free buffer.

        Returns the seconds the caller was blocked.
        """
        t0 = time.perf_counter()
        self.wait()
        tensors, objects = flatten_state(state)
        buf = self._buffer_for(tensors)
        buf.step, buf.rank, buf.layout, buf.complete = step, rank, dict(layout), False
        buf.objects = copy.deepcopy(objects)
        with self._lock:
            self._own.append(buf)
        self._thread = threading.Thread(target=self._copy, args=(buf, tensors), daemon=True)
        self._thread.start()
        return time.perf_counter() - t0

    def _copy(self, buf: Snapshot, tensors: dict[str, Any]) -> None:
        t0 = time.perf_counter()
        try:
            stream = torch.cuda.Stream() if self._pin else None
            with torch.cuda.stream(stream) if stream is not None else _nullcontext():
                for key, src in tensors.items():
                    dst = buf.tensors[key]
                    if isinstance(src, ShardRecord):
                        dst.local.copy_(src.local.detach(), non_blocking=self._pin)
                    else:
                        dst.copy_(src.detach(), non_blocking=self._pin)
            if stream is not None:
                stream.synchronize()
            with self._lock:
                buf.copy_s = time.perf_counter() - t0
                buf.complete, buf.reported = True, False
                self._retire_old()
        except BaseException as exc:  # reported by wait(); the previous snapshot stays good
            with self._lock:
                self._own.remove(buf)
            self._error = exc

    def wait(self) -> float:
        """Block until the copy in flight is done; returns the seconds waited."""
        t0 = time.perf_counter()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError(f"memory snapshot failed: {err}") from err
        return time.perf_counter() - t0

    def _buffer_for(self, tensors: dict[str, Any]) -> Snapshot:
        with self._lock:
            for i, cand in enumerate(self._free):
                if _same_structure(cand.tensors, tensors):
                    return self._free.pop(i)
            self._free.clear()  # layout changed: old buffers can never be reused
        return Snapshot(-1, -1, {k: _alloc_like(v, self._pin) for k, v in tensors.items()}, {})

    def _retire_old(self) -> None:
        """Keep the two newest complete snapshots; recycle older unleased buffers."""
        complete = [s for s in self._own if s.complete]
        for old in complete[:-2]:
            if old.leases == 0:
                self._own.remove(old)
                self._free.append(old)

    def unreported(self) -> list[Snapshot]:
        """Complete snapshots not yet reported to the controller (marks them reported)."""
        with self._lock:
            out = [s for s in self._own if s.complete and not s.reported]
            for s in out:
                s.reported = True
            return out

    def steps(self) -> list[int]:
        """Steps of the complete own snapshots, oldest first."""
        with self._lock:
            return sorted(s.step for s in self._own if s.complete)

    def newest(self) -> Snapshot | None:
        with self._lock:
            done = [s for s in self._own if s.complete]
            return max(done, key=lambda s: s.step) if done else None

    def holdings(self) -> dict[int, list[int]]:
        """Owner rank -> steps this process can serve (own snapshots and peer replicas)."""
        with self._lock:
            out: dict[int, set[int]] = {}
            for s in self._own:
                if s.complete:
                    out.setdefault(s.rank, set()).add(s.step)
            for owner, held in self._replicas.items():
                out.setdefault(owner, set()).update(held)
            return {owner: sorted(steps) for owner, steps in out.items()}

    def get(self, owner: int, step: int, lease: bool = False) -> Snapshot:
        """``owner``'s snapshot of ``step``: an own one taken as that rank, or a peer replica."""
        with self._lock:
            for s in self._own:
                if s.step == step and s.rank == owner and s.complete:
                    s.leases += int(lease)
                    return s
            if step in self._replicas.get(owner, {}):
                return self._replicas[owner][step]
        raise KeyError(f"no complete snapshot of rank {owner} at step {step} here")

    def keep_layout(self, layout: dict[str, int]) -> None:
        """Forget own snapshots taken under another layout (after a resize has settled)."""
        with self._lock:
            self._own = [s for s in self._own if s.layout == layout or s.leases > 0]

    def release(self, snap: Snapshot) -> None:
        with self._lock:
            snap.leases = max(0, snap.leases - 1)
            self._retire_old()

    # ------------------------------------------------------------------ peer replicas
    def store_replica(self, snap: Snapshot) -> None:
        with self._lock:
            held = self._replicas.setdefault(snap.rank, {})
            held[snap.step] = snap
            for old in sorted(held)[:-2]:
                del held[old]



def _alloc_like(value: Any, pin: bool) -> Any:
    if isinstance(value, ShardRecord):
        return ShardRecord(_alloc_like(value.local, pin), tuple(value.global_shape), tuple(value.offsets))
    return torch.empty(value.shape, dtype=value.dtype, device="cpu", pin_memory=pin)


def _same_structure(buf: dict[str, Any], tensors: dict[str, Any]) -> bool:
    if buf.keys() != tensors.keys():
        return False
    for k, v in tensors.items():
        old = buf[k]
        if isinstance(old, ShardRecord) != isinstance(v, ShardRecord):
            return False
        if isinstance(v, ShardRecord) and (old.global_shape != tuple(v.global_shape) or old.offsets != tuple(v.offsets)):
            return False
        a = old.local if isinstance(old, ShardRecord) else old
        b = v.local if isinstance(v, ShardRecord) else v
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
    return True


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
