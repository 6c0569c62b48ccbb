"""``RankRuntime``: what a rank actor is for its process's whole life, whatever it trains.

Two payloads run on it, each an actor that owns one runtime:

* the built-in language-model trainer: ``Rank`` (``elastic/worker/actor.py``, hosted by
  ``TrainWorker``), which builds a ``Trainer`` per generation and keeps memory snapshots;
* a user's Ray Train loop: ``LoopRank`` (``elastic/train/rank.py``), which enters the loop
  again per generation and keeps the checkpoints it reports.

What the runtime holds, the same under both:

* the process group: this process's membership in the job's group generation after
  generation (``ReconfigurableProcessGroup``: join a generation, capture its connections
  once built, settle, leave; the process, its imports and its CUDA context survive);
* the abort of a blocked collective: cut this rank's links (to lost peers, or all of them,
  which fails a collective blocked on one at once) and, for a payload that asks, the watch
  that logs a run still stuck after the abort and then leaves the process
  (``report_if_stuck``);
* liveness: the phase (``idle``, ``configure``, ``train``), the last beat, and whether a run
  is in progress (``idle``, an event the abort watch waits on);
* the training thread: each call of the actor's ``train`` concurrency group enters it
  (``training``), at the training thread's priority (``elastic/priority.py``);
* the snapshots: the memory tier (``elastic/checkpoint/memory_tier.py``), CPU buffers
  reused step after step, filled by a background copy that overlaps the next step, the two
  newest kept, and the peers' copies this rank keeps; a copy gives way to a recovery
  (``MemoryTier.yield_copy``, at an abort). The built-in trainer snapshots its whole state
  after every step; a loop's step guard its model and optimizer (``elastic/train/step_guard.py``);
* the device a rank trains on (``device``), where it runs (``where``, ``gpus``) and its
  resident memory (``rss_bytes``);
* the process's set-up when the actor starts (``settle_process``): ``kill -USR1 <pid>`` dumps
  every thread's stack to the worker's log (where a hung rank is stuck) and a fatal signal
  prints them too; the control threads at a higher priority than the training thread, so a
  rank answers its driver's pings under any load; what is alive at start frozen out of the
  garbage collector's scans (``elastic/worker/heap.py``); and, where asked, torch's threads
  and glibc's handling of freed memory (``elastic/worker/allocator.py``);
* the exit path (``close``).

What each payload keeps for itself: what it trains and how, what goes into the snapshots
and when, the checkpoints a loop reports (files, in the rank's memory), its restore, its stop at a boundary, and the
messages it answers with (typed: ``elastic/messages.py`` for the built-in trainer,
``elastic/train/loop_messages.py`` for a loop).

What each payload answers its driver, under the same names (``RankPayload``): ``info``
(where it runs), ``poll`` (its reports since the last poll), ``abort_step`` (leave the step
in flight, this rank's links to the lost peers cut), ``request_stop`` (stop at the next
boundary the job can continue from: a step for the built-in trainer, a report with a
checkpoint for a loop), ``store_replica`` (keep a peer's copy of its state) and ``run``
(train; how it ended).

Runs in the rank's process; imports nothing of the control package.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import threading
import time
from collections.abc import Collection, Iterator
from typing import Any, Protocol, runtime_checkable

import ray
import torch

from elastic.checkpoint.memory_tier import MemoryTier
from elastic.messages import Connection, WorkerInfo
from elastic.priority import control_priority, training_thread
from elastic.worker.abort import leave_process, report_if_stuck
from elastic.worker.allocator import keep_freed_memory
from elastic.worker.heap import settle_heap
from elastic.worker.process_group import ReconfigurableProcessGroup


class RankRuntime:
    """One rank's process group, abort, liveness, device and training thread (the module docstring)."""

    def __init__(self, device_type: str, collective_timeout_s: float, connect_world_at_once: bool = False):
        """``connect_world_at_once``: a gloo world group connects every pair when it forms
        (a user's loop may use any pair), instead of on first use (the built-in trainer)."""
        self.device_type = device_type
        self.group = ReconfigurableProcessGroup(device_type, collective_timeout_s)
        if connect_world_at_once:
            self.group.lazy_world = False
        self.phase = "idle"
        self.beat = time.monotonic()
        self.idle = threading.Event()  # no run in progress
        self.idle.set()
        self.aborted = threading.Event()  # the driver abandoned the step in flight
        self.tier = MemoryTier(device_type)  # the snapshots: what goes in it is the payload's

    # ------------------------------------------------------------------ the process
    def settle_process(self, threads: int | None = None, keep_freed: bool = False) -> None:
        """Set the rank's process up once, when its actor starts (the module docstring):
        ``threads``, torch's intra-op threads (None: as Ray's ``OMP_NUM_THREADS`` left
        them); ``keep_freed``, a CPU process keeps the memory it frees for its next
        allocations (the built-in trainer's re-formations; a loop's memory is its own)."""
        faulthandler.register(signal.SIGUSR1, all_threads=True)
        faulthandler.enable(all_threads=True)
        if threads is not None:
            torch.set_num_threads(max(1, threads))
        # The control threads at -5 where allowed, else 0 (the import left Ray's niceness, 15);
        # the training thread goes to 0 with its first call (elastic/priority.py).
        control_priority()
        # Everything alive now (torch, Ray, imported modules, and pandas, which pyarrow would
        # import at the first read) lives as long as the process: frozen, so that the full
        # collection of a re-formation does not scan it again (elastic/worker/heap.py).
        settle_heap()
        if keep_freed:
            keep_freed_memory(self.device_type)

    # ------------------------------------------------------------------ where it runs
    def where(self) -> WorkerInfo:
        return WorkerInfo(ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), os.getpid())

    def gpus(self) -> list[Any]:
        """The GPUs Ray gave this actor (none on CPU)."""
        return ray.get_runtime_context().get_accelerator_ids().get("GPU", [])

    def device(self, local_rank: int = 0) -> torch.device:
        """The device this rank trains on, made current: its GPU (Ray sets
        ``CUDA_VISIBLE_DEVICES`` to the actor's, so it is device 0; outside Ray's GPU
        accounting, device ``local_rank``), or the CPU."""
        if self.device_type != "cuda":
            return torch.device("cpu")
        gpus = ray.get_gpu_ids() if ray.is_initialized() else []
        index = 0 if gpus else local_rank
        torch.cuda.set_device(index)
        return torch.device("cuda", index)

    # ------------------------------------------------------------------ the process group
    @property
    def generation(self) -> int:
        return self.group.generation

    def join(
        self,
        generation: int,
        rank: int,
        world: int,
        store: tuple[str, int],
        secret: str = "",
        shrink_excluded: tuple[int, ...] | None = None,
    ) -> float:
        """Leave the current generation (if any) and join ``generation`` as ``rank`` of
        ``world``; returns the join time in s (``ReconfigurableProcessGroup.join``). Until
        ``settled``, the driver may abandon it (``abandon``)."""
        return self.group.join(generation, rank, world, store, secret, shrink_excluded)

    def built(self) -> None:
        """The group and everything built over it (a mesh, wrappers) exist: their
        connections are captured, to be cut on a failure."""
        self.group.built()

    def settled(self) -> None:
        """This rank's part in forming its generation is over (it joined, or it failed)."""
        self.group.settled()

    def abandon(self, generation: int) -> None:
        """Give up joining ``generation``: a peer was lost while it formed."""
        self.group.abandon(generation)

    def leave(self, collect: bool = True) -> None:
        """Leave the group so that peers blocked on this rank fail at once (call after
        dropping the payload's references to what it built over the group)."""
        self.group.leave(collect=collect)

    def connected(self) -> bool:
        """Whether this rank holds connections of a group (captured at ``built``; none on NCCL)."""
        return bool(self.group.connections())

    # ------------------------------------------------------------------ the abort
    def cut(self, links: Collection[Connection] | None = None) -> int:
        """Shut down this rank's ``links`` (to lost peers), or every connection of its group
        (None): a collective blocked on one fails now. Returns how many were cut."""
        return self.group.cut_all() if links is None else self.group.cut_links(links)

    def leave_if_stuck(self) -> None:
        """After an abort: a run not over in 5 s logs its stacks and cuts all its links, and
        one still blocked in a collective 1 s later leaves the job (``report_if_stuck``). No
        run in progress: nothing to watch."""
        report_if_stuck(self.idle, then=self.group.cut_all, leave=leave_process)

    # ------------------------------------------------------------------ liveness, the training thread
    def touch(self) -> None:
        """A beat: the rank is alive and making progress."""
        self.beat = time.monotonic()

    def enter(self, phase: str) -> None:
        """A call of the ``train`` concurrency group begins ``phase`` (``configure``,
        ``train``): the calling thread is the training thread, at its priority."""
        training_thread()
        self.phase = phase

    def ready(self) -> None:
        """The payload is built on its new generation and may run: the last one's abort is over."""
        self.aborted.clear()
        self.phase = "ready"
        self.touch()

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """A run in progress (the abort watch waits for its end); idle again afterwards."""
        self.idle.clear()
        try:
            yield
        finally:
            self.phase = "idle"
            self.touch()
            self.idle.set()

    def close(self) -> None:
        """The rank leaves the job: out of its group."""
        self.group.leave()


@runtime_checkable
class RankPayload(Protocol):
    """What a payload on the runtime answers its driver (the module docstring); each takes
    its own messages, so only the names and their meaning are shared."""

    def info(self) -> WorkerInfo: ...

    def poll(self, *args: Any, **kwargs: Any) -> Any: ...

    def abort_step(self, generation: int = 0, links: Any = ...) -> Any: ...

    def request_stop(self) -> None: ...

    def store_replica(self, *args: Any) -> bool: ...

    def run(self, *args: Any) -> Any: ...


def rss_bytes() -> int:
    """This process's resident memory in bytes (0 where ``/proc`` is not there)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


__all__ = ["RankPayload", "RankRuntime", "rss_bytes"]
