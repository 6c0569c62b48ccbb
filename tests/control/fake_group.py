"""A scripted stand-in for ``WorkerGroup``: the controller's test seam.

It holds no actors. Capacity is a number, observations come from a script, and every
call the controller makes is recorded, so a test can step the state machine one
transition at a time and check each decision.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, field
from typing import Any

from elastic.control.worker_group.api import ConfigureResult, Observation
from elastic.messages import StepReport
from elastic.placement.planned import placement_fields


@dataclass
class FakeMember:
    rank: int
    group: Any
    node_id: str
    dead: bool = False
    step: int = 0
    last_ok: float = 0.0
    pid: int = 0
    ip: str = ""


def _new_members(groups):
    return [FakeMember(-1, g, f"node-{g}") for g in groups]


@dataclass
class FakeWorkerGroup:
    spec: Any
    corpus_uri: str
    step_hook: Any = None
    storage_uri: str = ""
    capacity: int = 4  # replicas Ray could place now
    script: list[Observation] = field(default_factory=list)
    snapshot_step: int | None = None
    calls: list[tuple] = field(default_factory=list)
    drain_progress: dict[int, int] = field(default_factory=dict)
    draining: dict[str, Any] = field(default_factory=dict)  # node id -> DrainNotice
    configure_failures: list[Any] = field(default_factory=list)  # raised by the next configure calls
    collector_on: list[bool] = field(default_factory=list)  # gc.isenabled() in each configure
    starting_polls: int = 0  # spawn_end answers None this many times before a begun start is done
    start_failure: Any = None  # raised by spawn_end instead, once the polls are spent

    def __post_init__(self):
        self.members: list[FakeMember] = []
        self.dp = 0
        self._next_group = 0

    # capacity -------------------------------------------------------------
    def _groups(self, n):
        out = []
        for _ in range(n):
            out.append(f"pg{self._next_group}")
            self._next_group += 1
        return out

    def request_capacity(self):
        self.calls.append(("request_capacity",))

    def spare_groups(self, timeout=0.0):
        used = len({m.group for m in self.members if not m.dead})
        return self._groups(max(0, self.capacity - used))

    def wait_spare(self, count, timeout):
        self.calls.append(("wait_spare", count))
        return self.spare_groups()

    def spawn(self, groups):
        self.calls.append(("spawn", len(groups)))
        return _new_members(groups)

    def spawn_begin(self, groups):
        """As the real group: the start is begun here and collected by ``spawn_end``."""
        self.calls.append(("spawn_begin", len(groups)))
        return _new_members(groups)

    def spawn_end(self, pending, wait_s):
        if self.starting_polls > 0:
            self.starting_polls -= 1
            return None
        if self.start_failure is not None:
            failure, self.start_failure = self.start_failure, None
            raise failure
        self.calls.append(("spawn_end", len(pending)))
        return pending

    def spawn_cancel(self, pending):
        self.calls.append(("spawn_cancel", len(pending)))

    def release_group(self, group):
        self.calls.append(("release", group))

    def exclude_nodes(self, nodes):
        self.calls.append(("exclude", sorted(nodes)))

    def draining_nodes(self):
        return dict(self.draining)

    def avoid(self, nodes):
        if nodes:
            self.calls.append(("avoid", sorted(nodes)))

    # configuration --------------------------------------------------------
    def snapshot_holdings(self, members):
        """Every live member holds its own snapshot of ``snapshot_step`` (None: nothing)."""
        if self.snapshot_step is None:
            return [None for _ in members]
        return [None if m.dead else {m.rank: [self.snapshot_step]} for m in members]

    def reform(self, plan):
        self.calls.append(("reform", plan.dp, plan.restore.step, plan.restore.source))
        self.collector_on.append(gc.isenabled())
        for rank, m in enumerate(plan.members):
            m.rank = rank
        self.members = list(plan.members)  # as the real group: the members, even if configure fails
        if self.configure_failures:
            failure = self.configure_failures.pop(0)
            for m in plan.members:  # as worker_group/configure.py: the members lost in a configure are dead
                m.dead = m.dead or (getattr(failure, "cause", "") == "node_lost" and m.rank in failure.ranks)
            raise failure
        self.dp = plan.dp
        for m in plan.members:
            m.step = plan.step
        return ConfigureResult(step=plan.step, init_s=0.01, build_s=0.01, restore_s=0.02)

    def rack_of(self, node_id):
        return ""

    # running --------------------------------------------------------------
    def launch(self, last_step):
        self.calls.append(("launch", last_step))

    def observe(self, timeout=0.1):
        return self.script.pop(0) if self.script else Observation()

    def drain_results(self, members, timeout=10.0):
        """Like the real group's drain, this refreshes each member's own step counter (its
        poll answer) from ``drain_progress`` (rank -> the step the worker reports)."""
        for m in members:
            if m.rank in self.drain_progress:
                m.step = self.drain_progress[m.rank]
        return []

    def abort_steps(self, members, lost=()):
        self.calls.append(("abort_steps", [m.rank for m in members], [m.rank for m in lost]))

    def shrink(self, members, excluded):
        self.calls.append(("shrink", [m.rank for m in members], list(excluded)))

    def kill(self, members):
        for m in members:
            m.dead = True
        self.calls.append(("kill", sorted(m.rank for m in members)))

    def wait_runs(self, members, timeout):
        return []

    def request_stop(self):
        self.calls.append(("request_stop",))

    def save_checkpoints(self, timeout):
        self.calls.append(("save_checkpoints",))

    def shutdown(self):
        self.calls.append(("shutdown",))

    def placement(self):
        p = self.spec.parallel
        return placement_fields(self.dp, p.tp, p.pp, [m for m in self.members if not m.dead], {})

    def pid_of(self, rank):
        return 0

    def pids_on_node(self, node_id):
        return []


def step_results(step: int, ranks: int, loss: float = 1.0) -> list[tuple[int, StepReport]]:
    report = StepReport(
        step=step, loss=loss, grad_norm=1.0, step_time_s=0.01, batch_index=step - 1, peak_mem_bytes=0, done_at=0.0
    )
    return [(r, report) for r in range(ranks)]
