"""The control plane on a real Ray: what a node agent's loss, a busy driver and a hung rank
do to a run (elastic/agent/, elastic/control/agent_link.py, worker_group/poll.py, reform.py).

Each run is compared with the fault-free run of the same spec, per step, at 1e-5.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from elastic_testlib import REL_SAME_ORDER, STEPS, assert_matches_reference, elastic_spec, events_of, step_metrics

from elastic import ElasticTrainer
from elastic.control.callbacks import Callback
from elastic.faults import Fault, FaultInjector, WorkerFaults, worker_fault

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]


class _AgentKillerAndStall(Callback):
    """At ``kill_at`` SIGKILLs the node agent of rank 0's node (the node stays); at ``stall_at``
    the driver sleeps ``stall_s`` (it is busy: nothing may be judged silent for that)."""

    def __init__(self, kill_at: int, stall_at: int, stall_s: float):
        self.kill_at, self.stall_at, self.stall_s = kill_at, stall_at, stall_s
        self.killed_pid: int | None = None
        self.new_pid: int | None = None
        self.stalled_s = 0.0

    def after_step(self, step, group) -> None:
        node = group.members[0].node_id
        if step == self.kill_at and self.killed_pid is None:
            self.killed_pid = group.agent_pid(node)
            os.kill(self.killed_pid, signal.SIGKILL)
        elif step == self.stall_at and not self.stalled_s:
            t0 = time.monotonic()
            time.sleep(self.stall_s)
            self.stalled_s = time.monotonic() - t0
        elif self.killed_pid is not None and self.new_pid is None and step > self.kill_at + 2:
            self.new_pid = group.agent_pid(node)  # the agent that answers now


def test_lost_agent_stalled_driver_and_hung_rank(ray_local, reference_losses, tmp_path):
    """One run, three faults of the control plane (one run: each costs a cluster's start).

    A node agent that dies while its node lives is replaced, and a driver stalled for
    2 x heartbeat_timeout_s blames nobody: no failure until the one injected. Then rank 1
    hangs in its step while rank 0 is killed: it is freed within a few steps' time, not
    waited for until the collective timeout (30 s here); the survivors go on, 0 lost steps,
    the fault-free losses."""
    spec = elastic_spec(min_dp=1, max_dp=4, heartbeat_timeout_s=2, collective_timeout_s=30)
    hook = _AgentKillerAndStall(kill_at=4, stall_at=8, stall_s=2 * spec.elastic.heartbeat_timeout_s)
    faults = [worker_fault("slow", step=1, rank=r, seconds=0.1) for r in range(4)]  # the run outlasts the stall
    faults.append(worker_fault("hang", step=15, rank=1, seconds=120))
    injector = FaultInjector([Fault("kill_worker", at_step=14, rank=0)])
    trainer = ElasticTrainer(
        spec, run_dir=str(tmp_path / "run"), callbacks=[hook, injector], step_hook=WorkerFaults(faults)
    )
    result = trainer.fit()
    assert result.status == "succeeded" and result.steps == STEPS
    assert hook.stalled_s >= 2 * spec.elastic.heartbeat_timeout_s
    assert hook.killed_pid is not None and hook.new_pid not in (None, hook.killed_pid)
    (failure,) = events_of(trainer.run_dir, "failure")  # the injected kill only
    assert 0 in failure["ranks"], failure
    (rec,) = result.recoveries
    print("recovery:", rec)
    assert rec.breakdown["free_s"] < 10.0, rec.breakdown  # was collective_timeout_s + 5
    assert rec.lost_steps == 0
    assert_matches_reference(step_metrics(trainer.run_dir), reference_losses, rel=REL_SAME_ORDER)
