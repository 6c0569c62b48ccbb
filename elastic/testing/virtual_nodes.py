"""Virtual ranks for the control-plane benchmark (``benchmarks/control_plane.py``).

A virtual rank answers the node agent's calls the way a ``TrainWorker`` would, from the
clock and without torch: it completes a step every ``step_s`` (a ``StepReport`` with a
snapshot), takes ``configure_s`` to re-form, holds the snapshots of its last two steps,
stops at the next step boundary when asked, and leaves ``run()`` with a peer error shortly
after another node is lost. The agents that watch them are the real ones (``NodeAgent``
actors, or ``NodeCore``s hosted by an aggregator for the nodes without an actor of their
own), and so are the aggregators and the whole driver.

What it does not cover: the collectives and the device work of a real rank, the time a
real re-formation takes (``configure_s`` stands for it), and a node agent's own RPCs to its
ranks (local calls on the node, not the driver's).

A node is lost by naming it in the *fabric* file (``Fabric.lose``): its agent dies (a real
agent's process exits; a hosted one stops answering), and the ranks of every other node
see a peer error ``peer_error_s`` later. Each process reads the file every
``FABRIC_CHECK_S`` and wakes its agents when it changes.
"""

from __future__ import annotations

import json
import os
import threading
import time
import zlib
from dataclasses import dataclass, field
from typing import Any, Protocol

from elastic.agent.bell import Doorbell
from elastic.agent.node import AgentGone, NodeCore
from elastic.messages import (
    ConfigureReply,
    Poll,
    PollReply,
    RankCall,
    Reconfigure,
    RequestStop,
    Run,
    RunOutcome,
    SaveCheckpoint,
    SnapshotHoldings,
    SnapshotReport,
    StepReport,
    WorkerReport,
)

FABRIC_CHECK_S = 0.05


class Bell(Protocol):
    """What wakes a virtual node's agent: a ``Doorbell`` (an agent actor), or its process's
    ``_HostLoop`` (hosted nodes)."""

    def ring(self) -> None: ...

    def answer(self, timeout_s: float) -> bool: ...


@dataclass(frozen=True)
class VirtualRankRef:
    """What stands for a virtual rank's actor handle (in ``Member.actor`` and the requests)."""

    wid: int


@dataclass(frozen=True)
class VirtualWorld:
    """What every virtual node of a run shares (picklable: it travels to the agents)."""

    fabric_path: str
    step_s: float
    configure_s: float = 0.05
    peer_error_s: float = 0.01
    jitter_s: float = 0.005  # nodes finish a step this far apart at most

    @property
    def poll_wait_s(self) -> float:
        return max(1.0, 2 * self.step_s)

    def backend(self, node: str, bell: Doorbell) -> VirtualRanks:
        """For a ``NodeAgent`` actor (``virtual=``): its own process, its own fabric reader."""
        fabric = Fabric(self.fabric_path)
        fabric.watch(bell.ring)
        return VirtualRanks(node, self, fabric, bell)


@dataclass(frozen=True)
class LocalVirtualAgent:
    """A virtual node's agent hosted by an aggregator (``Aggregator.adopt`` calls ``start``
    with a dict the aggregator's local children share: here, the process's fabric reader and
    the one thread that pumps every hosted node, ``_HostLoop``)."""

    node: str
    world: VirtualWorld

    def start(self, host: dict[str, Any]) -> NodeCore:
        fabric = host.get("fabric")
        if fabric is None:
            fabric = host["fabric"] = Fabric(self.world.fabric_path)
        loop = host.get("loop")
        if loop is None:
            loop = host["loop"] = _HostLoop()
            fabric.watch(loop.ring)
        core = NodeCore(
            self.node, VirtualRanks(self.node, self.world, fabric, loop), poll_wait_s=self.world.poll_wait_s
        )
        loop.add(core)
        return core


class _HostLoop:
    """One thread pumping every virtual node of its process, each when its next answer is
    due (``NodeCore.pump(0)`` never blocks), or all at once when one is rung (a command, a
    change in the fabric). A thread per hosted node ran 2,048 of them on 2 cores at a load
    average past 700 and starved the aggregators (2026-11-26)."""

    MAX_SLEEP_S = 1.0  # every node is looked at this often at least (its silence checks)

    def __init__(self) -> None:
        self.cores: list[NodeCore] = []
        self._lock = threading.Lock()
        self._rung = threading.Event()
        threading.Thread(target=self._run, daemon=True, name="virtual nodes").start()

    # the ``Doorbell`` a ``VirtualRanks`` uses: ``ring`` wakes the loop; ``answer`` is never
    # reached, since the loop's pumps wait for nothing
    def ring(self) -> None:
        self._rung.set()

    def answer(self, timeout_s: float) -> bool:
        return self._rung.wait(timeout_s)

    def add(self, core: NodeCore) -> None:
        with self._lock:
            self.cores.append(core)
        self.ring()

    def _run(self) -> None:
        due: dict[int, float] = {}  # id(core) -> unix time of its next pump
        while True:
            now = time.time()
            wait = min([now + self.MAX_SLEEP_S, *due.values()]) - now
            rung = self._rung.wait(max(0.0, wait))
            self._rung.clear()
            now = time.time()
            with self._lock:
                cores = [c for c in self.cores if not c.gone]
            for core in cores:
                if rung or due.get(id(core), 0.0) <= now:
                    try:
                        core.pump(0.0)
                    except AgentGone:
                        core.gone = True
                        due.pop(id(core), None)
                        continue
                    due[id(core)] = _next_due(core, now + self.MAX_SLEEP_S)


def _next_due(core: NodeCore, latest: float) -> float:
    """Unix time when ``core`` next has something to take in: an answer of its virtual
    ranks, or a time of its own (a linger, a silence check)."""
    backend = core.backend
    assert isinstance(backend, VirtualRanks)
    with core.cond:
        times = [backend._due(f) for f in core.inflight]
        wake = core._next_wake()
    if wake is not None:
        times.append(time.time() + (wake - core.clock()))
    return min([latest, *times])


class Fabric:
    """The lost nodes of a run (node -> unix time of the loss), read from the fabric file."""

    def __init__(self, path: str):
        self.path = path
        self.lost: dict[str, float] = {}
        self._mtime = 0.0
        self._wakers: list[Any] = []
        self._lock = threading.Lock()
        self._read()
        threading.Thread(target=self._watch, daemon=True, name="fabric").start()

    @staticmethod
    def lose(path: str, node: str) -> None:
        """Lose ``node`` now (from the benchmark's process)."""
        lost = json.load(open(path)) if os.path.exists(path) else {}
        lost[node] = time.time()
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(lost, f)
        os.replace(tmp, path)

    def watch(self, wake: Any) -> None:
        with self._lock:
            self._wakers.append(wake)

    def _read(self) -> bool:
        try:
            mtime = os.stat(self.path).st_mtime
        except FileNotFoundError:
            return False
        if mtime == self._mtime:
            return False
        self._mtime = mtime
        with open(self.path) as f:
            self.lost = json.load(f)
        return True

    def _watch(self) -> None:
        while True:
            time.sleep(FABRIC_CHECK_S)
            if self._read():
                with self._lock:
                    wakers = list(self._wakers)
                for wake in wakers:
                    wake()

    def first_loss_after(self, node: str, t: float) -> float | None:
        """The earliest loss of another node after ``t`` (unix time), if any."""
        times = [at for n, at in self.lost.items() if n != node and at > t]
        return min(times) if times else None


@dataclass
class _VRank:
    wid: int
    rank: int = -1
    step: int = 0  # the last step completed (before the run in progress)
    reported: int = 0  # the last step handed over by a poll
    runs: int = 0
    start: float | None = None  # unix time the run in progress began
    first: int = 0  # its first step is first + 1
    last: int = 0
    stop_at: float | None = None  # unix time a stop was asked for
    outcome: RunOutcome | None = None
    flush_at: float = 0.0  # unix time of the last flush (a poll with no wait)


@dataclass(eq=False)
class _VFuture:
    rank: _VRank
    call: RankCall
    issued: float  # unix time
    result: tuple[str, Any] | None = field(default=None)


class VirtualRanks:
    """The ranks of one virtual node (a ``RankBackend`` for ``NodeCore``)."""

    def __init__(self, node: str, world: VirtualWorld, fabric: Fabric, bell: Bell):
        self.node, self.world, self.fabric, self.bell = node, world, fabric, bell
        self.ranks: dict[int, _VRank] = {}
        self.jitter = (zlib.crc32(node.encode()) % 1000) / 1000 * world.jitter_s

    # ------------------------------------------------------------------ RankBackend
    def call(self, handle: Any, call: RankCall) -> _VFuture:
        r = self.ranks.setdefault(handle.wid, _VRank(handle.wid))
        now = time.time()
        f = _VFuture(r, call, now)
        if isinstance(call, Run):
            self._settle(r, now)
            r.runs, r.outcome, r.stop_at = r.runs + 1, None, None
            r.start, r.first, r.last = now + self.jitter, r.step, call.last_step
        elif isinstance(call, Poll) and not call.wait_s:  # a flush: a long poll in flight answers now too
            r.flush_at = now
        elif isinstance(call, RequestStop):
            if r.start is not None and r.stop_at is None:
                r.stop_at = now
        return f

    def wait(self, futures: list[_VFuture], timeout_s: float) -> list[_VFuture]:
        deadline = time.time() + timeout_s
        while True:
            if self.node in self.fabric.lost:
                raise AgentGone(self.node)  # the node is lost: its agent with it
            now = time.time()
            ready = [f for f in futures if self._due(f) <= now]
            if ready or now >= deadline:
                return ready
            until = min([deadline] + [self._due(f) for f in futures])
            if self.bell.answer(max(0.0, until - now)):  # a command or the fabric rang: look again
                return [f for f in futures if self._due(f) <= time.time()]

    def result(self, f: _VFuture) -> tuple[str, Any]:
        if self.node in self.fabric.lost:
            return "dead", None
        return "ok", self._answer(f, time.time())

    def wake(self) -> None:
        self.bell.ring()

    def end(self, pid: int) -> None:
        pass  # a virtual rank has no process

    # ------------------------------------------------------------------ the clock's answers
    def _end(self, r: _VRank) -> tuple[float, RunOutcome] | None:
        """When and how the run in progress ends, as far as is known now."""
        if r.start is None:
            return None
        s = self.world.step_s
        ends = [(r.start + (r.last - r.first) * s, RunOutcome("done", r.last))]
        if r.stop_at is not None:
            k = min(r.last - r.first, int((r.stop_at - r.start) / s) + 1)
            ends.append((r.start + k * s, RunOutcome("stopped", r.first + k)))
        lost = self.fabric.first_loss_after(self.node, r.start)
        if lost is not None:
            k = max(0, min(r.last - r.first, int((lost - r.start) / s)))
            ends.append((lost + self.world.peer_error_s, RunOutcome("error", r.first + k, "peer", "peer lost")))
        return min(ends, key=lambda e: e[0])

    def _completed(self, r: _VRank, t: float) -> int:
        if r.start is None:
            return r.step
        end = self._end(r)
        done = int(max(0.0, t - r.start) / self.world.step_s)
        if end is not None and t >= end[0]:
            return end[1].step
        return min(r.first + done, end[1].step if end else r.last)

    def _due(self, f: _VFuture) -> float:
        r, call = f.rank, f.call
        if isinstance(call, Reconfigure):
            return f.issued + self.world.configure_s
        if not isinstance(call, Poll) or not call.wait_s:
            return f.issued
        due = f.issued + call.wait_s
        if r.flush_at >= f.issued:
            return r.flush_at
        if r.start is not None:
            end = self._end(r)
            nxt = r.start + (max(r.reported, r.first) - r.first + 1) * self.world.step_s
            due = min(due, nxt if end is None or nxt < end[0] else end[0])
            if self._completed(r, f.issued) > r.reported or r.outcome is not None:
                return f.issued
        return max(f.issued, due)

    def _settle(self, r: _VRank, now: float) -> None:
        """Fold a run that has ended into the rank's state."""
        end = self._end(r)
        if end is not None and now >= end[0]:
            r.step, r.outcome, r.start = end[1].step, end[1], None

    def _answer(self, f: _VFuture, now: float) -> Any:
        r, call = f.rank, f.call
        if isinstance(call, Poll):
            upto = self._completed(r, now)
            reports: list[WorkerReport] = [self._report(r, s) for s in range(r.reported + 1, upto + 1)]
            r.reported = max(r.reported, upto)
            self._settle(r, now)
            phase = "train" if r.start is not None else "idle"
            return PollReply(r.rank, upto, phase, 0.0, reports, r.outcome, r.runs)
        if isinstance(call, Reconfigure):
            req = call.req
            r.rank, r.step, r.reported, r.start, r.outcome = req.rank, req.step, req.step, None, None
            c = self.world.configure_s
            return ConfigureReply(req.rank, req.step, init_s=c / 2, build_s=c / 4, restore_s=c / 4)
        if isinstance(call, SnapshotHoldings):
            step = self._completed(r, now)
            return {r.rank: [s for s in (step - 1, step) if s > 0]}
        if isinstance(call, SaveCheckpoint):
            return True
        return None

    def _report(self, r: _VRank, step: int) -> StepReport:
        s = self.world.step_s
        done = (r.start or time.time()) + (step - r.first) * s
        noise = 1.0 + 0.02 * ((zlib.crc32(f"{r.wid}:{step}".encode()) % 1000) / 1000 - 0.5)
        return StepReport(
            step=step,
            loss=5.0 / (1 + 0.01 * step),
            grad_norm=1.0,
            step_time_s=s,
            batch_index=step - 1,
            peak_mem_bytes=0,
            done_at=done,
            compute_s=0.8 * s * noise,
            snapshot=SnapshotReport(step, 0.001, 0.01, 1 << 20),
        )
