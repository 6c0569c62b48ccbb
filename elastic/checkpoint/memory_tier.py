"""Memory tier: per-rank CPU snapshots of the training state, double-buffered.

Runs in each worker process (the training loop's snapshots, the peer copies it holds). A
snapshot (``snapshot.py``) is a flat mapping ``fqn -> tensor | ShardRecord | plain value``.
Tensors are copied into preallocated CPU buffers (pinned on CUDA) that are reused, so
steady-state snapshots allocate nothing.

Double buffering: a copy in progress always goes to a buffer that is not the newest
complete snapshot, so a failure during a copy never corrupts the last good one. A buffer
that the storage tier is still uploading is *leased* and is not reused until released;
a third buffer is allocated instead.

The copy runs on a background thread (on CUDA: non-blocking device-to-host copies on a
side stream). The training loop only has to call :meth:`wait` before it next mutates the
state (the optimizer step), so the copy overlaps the next forward/backward.

A copy in flight already counts as held (:meth:`holdings`): the state it copies does not
change before it is done (the next optimizer step waits for it, in this generation or the
next), and :meth:`get` waits for it. So a recovery does not wait for the copy of the step it
resumes from: a survivor keeping its live state needs only the step's data position and RNG
(:meth:`progress`, copied before the copy starts), and a peer fetching the snapshot waits
for the copy at that moment. When a peer is lost, the copy also gives way to the recovery
(:meth:`yield_copy`: its thread drops to ``BACKGROUND_NICE``); on a host whose cores the
ranks keep busy it otherwise takes the CPU the survivors need to leave their step and
re-form (a 0.5 GB state's copy on this 2-core machine: about 0.1 s per rank, still running
in 1 of 3 survivors when a loss right after a step was noticed, in one instrumented run).

Peer replicas: a rank can hold copies of other ranks' snapshots (``store_replica``), so a
lost rank's shard can be served by a survivor on another node. With a ``replicate_to``
sender set, every completed own snapshot is also sent to the rank's peer by a background
thread. The sender holds a lease on the buffer only while serialising it. Backpressure
keeps this deterministic: a new snapshot starts only once the previous one has reached
its peer (or ``replicate_timeout_s`` passed), so every snapshot is replicated, one at a
time, and the wait counts in the snapshot's ``blocking_s``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from elastic.checkpoint.snapshot import Snapshot, alloc_like, copy_plain, flatten_state, same_structure, unflatten_state
from elastic.priority import background_thread
from storage.records import ShardRecord

# Snapshot and unflatten_state are imported from here by the worker and the restore path.
__all__ = ["MemoryTier", "Snapshot", "flatten_state", "unflatten_state"]

logger = logging.getLogger(__name__)


class MemoryTier:
    def __init__(self, device: str = "cpu"):
        self._pin = device == "cuda" and torch.cuda.is_available()
        self._own: list[Snapshot] = []  # complete or in-progress own snapshots, oldest first
        self._free: list[Snapshot] = []  # buffers available for reuse
        self._replicas: dict[int, dict[int, Snapshot]] = {}  # owner rank -> step -> snapshot
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.layout: dict[str, int] | None = None  # the current layout; replicas of others are refused
        self._serving: dict[str, int] | None = None  # the layout whose own snapshots are served (keep_layout)
        # Peer replication: send(snapshot) delivers it to this rank's peer (blocking).
        self._send: Callable[[Snapshot], Callable[[], None]] | None = None
        self._replicate_timeout_s = 60.0
        self._sender: threading.Thread | None = None
        self.replicated: list[tuple[int, float, int]] = []  # (step, seconds, bytes) delivered, newest last
        self.replication_errors = 0
        self._protected: int | None = None  # an own snapshot kept until another is protected (docs/health.md)
        self._copy_tid: int | None = None  # the copy thread's native id while it runs
        self._yielding = False  # a peer was lost: the copy in flight runs in the background (yield_copy)

    # ------------------------------------------------------------------ own snapshots
    def snapshot_async(self, step: int, rank: int, state: dict[str, Any], layout: dict[str, int]) -> float:
        """Start copying ``state`` (``rank``'s, at ``step``) into a free buffer.

        Returns the seconds the caller was blocked.
        """
        t0 = time.perf_counter()
        self.wait()
        self.wait_replication()
        self._yielding = False  # a new copy runs at the training thread's priority
        tensors, objects = flatten_state(state)
        buf = self._buffer_for(tensors)
        buf.step, buf.rank, buf.layout, buf.complete = step, rank, dict(layout), False
        buf.objects = copy_plain(objects)
        with self._lock:
            self._own.append(buf)
        # On CUDA the copy runs on a side stream, on another thread: it must first wait for
        # what the training stream has queued (the optimizer step that produced this state).
        ready = None
        if self._pin:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream())
        self._thread = threading.Thread(target=self._copy, args=(buf, tensors, ready), daemon=True)
        self._thread.start()
        return time.perf_counter() - t0

    def _copy(self, buf: Snapshot, tensors: dict[str, Any], ready: Any = None) -> None:
        t0 = time.perf_counter()
        self._copy_tid = threading.get_native_id()
        if self._yielding:  # asked before this thread had its id
            background_thread(self._copy_tid)
        try:
            dsts, srcs = [], []
            for key, src in tensors.items():
                dst = buf.tensors[key]
                local = src.local if isinstance(src, ShardRecord) else src
                dsts.append(dst.local if isinstance(dst, ShardRecord) else dst)
                srcs.append(local.detach())
            stream = torch.cuda.Stream() if self._pin else None
            if stream is not None:
                stream.wait_event(ready)
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                # One call for every tensor: the per-tensor Python loop cost more than the
                # copies of a small model's tensors.
                torch._foreach_copy_(dsts, srcs, non_blocking=self._pin)
            if stream is not None:
                stream.synchronize()
            with self._lock:
                buf.copy_s = time.perf_counter() - t0
                buf.complete, buf.reported = True, False
                send = self._send
                if send is not None:
                    buf.leases += 1  # until serialised for the peer
                self._retire_old()
            if send is not None:
                self._sender = threading.Thread(target=self._replicate, args=(send, buf), daemon=True)
                self._sender.start()
        except BaseException as exc:  # reported by wait(); the previous snapshot stays good
            with self._lock:
                self._own.remove(buf)
            self._error = exc
        finally:
            self._copy_tid = None

    def yield_copy(self) -> None:
        """A peer was lost: the copy in flight (if any) gives way to the recovery's work
        (its thread at ``BACKGROUND_NICE``); the next snapshot's copy runs as before."""
        self._yielding = True
        tid = self._copy_tid
        if tid is not None:
            background_thread(tid)

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

    # ------------------------------------------------------------------ replication
    def replicate_to(self, send: Callable[[Snapshot], Callable[[], None]] | None, timeout_s: float = 60.0) -> None:
        """Send every completed own snapshot through ``send`` (None: stop replicating).

        ``send(snap)`` must serialise ``snap`` before it returns, and returns a callable that
        blocks until the peer has stored it. Called on the sender thread. Takes effect for
        snapshots completed from now on.
        """
        with self._lock:
            self._send, self._replicate_timeout_s = send, timeout_s
            self._sender = None  # one in flight to an old peer finishes on its own

    def _replicate(self, send: Callable[[Snapshot], Callable[[], None]], snap: Snapshot) -> None:
        t0 = time.perf_counter()
        try:
            try:
                delivered = send(snap)
            finally:
                self.release(snap)  # serialised: the buffer may be reused
            delivered()
            with self._lock:
                self.replicated = self.replicated[-7:] + [(snap.step, time.perf_counter() - t0, snap.nbytes)]
        except Exception as exc:  # the peer is gone: recovery will show it; training goes on
            self.replication_errors += 1
            logger.warning("replicating the snapshot of step %d to the peer failed: %s", snap.step, exc)

    def wait_replication(self) -> float:
        """Block until the replication in flight is delivered (at most the timeout)."""
        t0 = time.perf_counter()
        sender = self._sender
        if sender is not None:
            sender.join(self._replicate_timeout_s)
            if sender.is_alive():
                self.replication_errors += 1
                logger.warning(
                    "a snapshot replication did not finish within %.0fs; going on without it", self._replicate_timeout_s
                )
            self._sender = None
        return time.perf_counter() - t0

    def _buffer_for(self, tensors: dict[str, Any]) -> Snapshot:
        with self._lock:
            for i, cand in enumerate(self._free):
                if same_structure(cand.tensors, tensors):
                    return self._free.pop(i)
            self._free.clear()  # the state's shapes changed: these buffers can never be reused
        return Snapshot(-1, -1, {k: alloc_like(v, self._pin) for k, v in tensors.items()}, {})

    def _retire_old(self) -> None:
        """Keep the two newest complete snapshots; recycle older unleased buffers."""
        complete = [s for s in self._own if s.complete and s.step != self._protected]
        for old in complete[:-2]:
            if old.leases == 0:
                self._own.remove(old)
                self._free.append(old)

    def protect(self, step: int | None) -> None:
        """Keep the own snapshot of ``step`` (taken or still to come) beyond the two newest,
        until another step is protected: the SDC check's last verified state."""
        with self._lock:
            self._protected = step
            self._retire_old()

    def discard_after(self, step: int) -> None:
        """Forget own snapshots and peer replicas newer than ``step`` (after a rollback to it)."""
        with self._lock:
            for s in [s for s in self._own if s.complete and s.step > step]:
                self._own.remove(s)
                if s.leases == 0:
                    self._free.append(s)
            for owner in list(self._replicas):
                held = {k: v for k, v in self._replicas[owner].items() if k <= step}
                if held:
                    self._replicas[owner] = held
                else:
                    del self._replicas[owner]

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

    def holds_own(self, step: int, rank: int, layout: dict[str, int]) -> bool:
        """An own snapshot of ``step`` taken as ``rank`` under ``layout`` is held (or in flight)."""
        with self._lock:
            return any(s.step == step and s.rank == rank and s.layout == layout for s in self._own)

    def newest(self) -> Snapshot | None:
        with self._lock:
            done = [s for s in self._own if s.complete]
            return max(done, key=lambda s: s.step) if done else None

    def holdings(self) -> dict[int, list[int]]:
        """Owner rank -> steps this process can serve (own snapshots, the one in flight
        included, and peer replicas)."""
        with self._lock:
            out: dict[int, set[int]] = {}
            for s in self._own:  # complete, or in flight (module docstring)
                if self._current(s):
                    out.setdefault(s.rank, set()).add(s.step)
            for owner, held in self._replicas.items():
                out.setdefault(owner, set()).update(held)
            return {owner: sorted(steps) for owner, steps in out.items()}

    def get(self, owner: int, step: int, lease: bool = False) -> Snapshot:
        """``owner``'s snapshot of ``step``: an own one taken as that rank (once its copy is
        done), or a peer replica."""
        thread = self._thread
        if thread is not None and self._in_flight(owner, step) is not None:
            thread.join()  # its failure leaves it out of ``_own``: the lookup below then fails
        with self._lock:
            for s in self._own:
                if s.step == step and s.rank == owner and s.complete and self._current(s):
                    s.leases += int(lease)
                    return s
            if step in self._replicas.get(owner, {}):
                return self._replicas[owner][step]
        raise KeyError(f"no complete snapshot of rank {owner} at step {step} here")

    def _current(self, snap: Snapshot) -> bool:
        """Taken under the current layout: an older layout's snapshot that is still leased
        (a peer fetching it) stays in ``_own`` but is no longer served or reported."""
        return self._serving is None or snap.layout == self._serving

    def progress(self, owner: int, step: int) -> dict[str, Any]:
        """The plain values (step, data position, RNG) of the own snapshot of ``step`` taken
        as ``owner``, its copy done or not: a survivor resuming from its live state needs
        only these."""
        with self._lock:
            for s in self._own:
                if s.step == step and s.rank == owner:
                    return s.objects
        raise KeyError(f"no own snapshot of step {step} as rank {owner}")

    def _in_flight(self, owner: int, step: int) -> Snapshot | None:
        with self._lock:
            return next((s for s in self._own if s.step == step and s.rank == owner and not s.complete), None)

    def relabel(self, step: int, old_rank: int, rank: int, layout: dict[str, int]) -> bool:
        """Take the own snapshot of ``step`` made as ``old_rank`` under another layout as
        ``rank``'s under ``layout``, without a copy: for a survivor whose live state is the
        state that snapshot holds (it kept its state across a resize). Sent to the peer of
        the new layout when one is set. False when there is no such snapshot here."""
        self.wait_replication()
        with self._lock:
            snap = next(
                (
                    s
                    for s in self._own
                    if s.step == step and s.rank == old_rank and s.layout != layout and s.leases == 0
                ),
                None,
            )
            if snap is None:
                return False
            snap.rank, snap.layout = rank, dict(layout)
            send = self._send if snap.complete else None  # one in flight is sent when its copy is done
            if send is not None:
                snap.leases += 1  # until serialised for the peer
        if send is not None:
            self._sender = threading.Thread(target=self._replicate, args=(send, snap), daemon=True)
            self._sender.start()
        return True

    def keep_layout(self, layout: dict[str, int]) -> None:
        """Forget snapshots and replicas taken under another layout (after a resize has settled).

        Ranks are renumbered on a resize, so an old replica could be mistaken for a new
        rank's; from now on replicas of another layout are refused.
        """
        with self._lock:
            self.layout, self._serving = dict(layout), dict(layout)
            # Their buffers are kept for reuse: a state whose shapes the resize left alone (a
            # DDP replica, an HSDP shard group that stayed) fills them without new allocations.
            self._free += [s for s in self._own if s.layout != layout and s.complete and s.leases == 0]
            self._own = [s for s in self._own if s.layout == layout or s.leases > 0]
            for owner in list(self._replicas):
                held = {step: r for step, r in self._replicas[owner].items() if r.layout == layout}
                if held:
                    self._replicas[owner] = held
                else:
                    del self._replicas[owner]

    def release(self, snap: Snapshot) -> None:
        with self._lock:
            snap.leases = max(0, snap.leases - 1)
            self._retire_old()

    # ------------------------------------------------------------------ peer replicas
    def store_replica(self, snap: Snapshot) -> bool:
        """Keep ``snap`` (another rank's) for recovery; the two newest per owner are kept.

        Returns False, keeping nothing, when it was taken under another layout than the
        current one (a late arrival from before a resize).
        """
        with self._lock:
            if self.layout is not None and snap.layout != self.layout:
                return False
            held = self._replicas.setdefault(snap.rank, {})
            held[snap.step] = snap
            for old in sorted(held)[:-2]:
                del held[old]
            return True
