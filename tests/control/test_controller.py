"""The controller state machine, stepped one transition at a time over a scripted fake group."""

from __future__ import annotations

import gc

import pytest
from fake_group import FakeWorkerGroup, step_results

from elastic.control.controller import Controller, Failed, Finished, Recovering, Resizing, Running, Starting
from elastic.control.worker_group.api import Observation
from elastic.errors import ActorDied, JobFailed, NodeLost, WorkerError
from elastic.events import EventLog, read_events
from jobs import JobSpec

pytestmark = pytest.mark.timeout(60)


def _spec(**elastic):
    return JobSpec.from_dict(
        {
            "model": {"n_layers": 2, "d_model": 32, "n_heads": 4, "vocab_size": 64, "seq_len": 16},
            "parallel": {"micro_batch": 1},
            "elastic": {
                "min_dp": 1,
                "max_dp": 4,
                "max_failures": 2,
                "min_dp_wait_s": 1,
                "grow_check_s": 0.01,
                **elastic,
            },
            "train": {"steps": 3, "global_batch": 12},
        }
    )


class _Controller(Controller):
    worker_group_cls = FakeWorkerGroup


def _controller(tmp_path, spec=None, capacity=4):
    ctl = _Controller(spec or _spec(), EventLog(str(tmp_path)), "memory://corpus")
    ctl.group.capacity = capacity
    return ctl


def _advance(ctl, expected):
    ctl.state = ctl._step(ctl.state)
    assert type(ctl.state) is expected, f"expected {expected.__name__}, got {type(ctl.state).__name__}"
    return ctl.state


def test_start_run_finish(tmp_path):
    ctl = _controller(tmp_path)
    assert isinstance(ctl.state, Starting)
    _advance(ctl, Running)
    assert ctl.group.dp == 4 and ctl.dp_history == [[0, 4]]
    ctl.group.script = [
        Observation(results=step_results(1, 4) + step_results(2, 4)),
        Observation(results=step_results(3, 4), finished=True),
    ]
    _advance(ctl, Running)
    assert ctl.step == 2
    _advance(ctl, Finished)
    steps = [e for e in read_events(str(tmp_path)) if e["kind"] == "step"]
    assert [e["step"] for e in steps] == [1, 2, 3] and all(e["grad_accum"] == 3 for e in steps)


def test_start_uses_largest_allowed_dp(tmp_path):
    # global_batch 12 / micro 1: dp 1,2,3,4 allowed; with max_dp 4 but 3 replicas of room -> 3.
    ctl = _controller(tmp_path, capacity=3)
    _advance(ctl, Running)
    assert ctl.group.dp == 3


def test_node_lost_shrinks_in_whole_replicas(tmp_path):
    ctl = _controller(tmp_path)
    _advance(ctl, Running)
    ctl.group.script = [
        Observation(results=step_results(1, 4)),
        Observation(failure=NodeLost("gone", ranks=[3], nodes=["n3"])),
    ]
    _advance(ctl, Running)
    state = _advance(ctl, Recovering)
    assert state.failure.cause == "node_lost"
    ctl.group.capacity = 3  # the node did not come back
    ctl.group.snapshot_step = 1
    _advance(ctl, Running)
    assert ("kill", [3]) in ctl.group.calls
    assert ("reform", 3, 1, "memory") in ctl.group.calls
    # No cyclic-GC pause on a re-formation's path (gc_pauses.py), the collector back after it.
    assert ctl.group.collector_on == [False, False] and gc.isenabled()
    kinds = [(e["kind"], e.get("old_dp"), e.get("new_dp"), e.get("source")) for e in read_events(str(tmp_path))]
    assert ("resize", 4, 3, None) in kinds and ("restore", None, None, "memory") in kinds
    # The recovery is recorded once the first step at the new size is done.
    assert ctl.recoveries == []
    ctl.group.script = [Observation(results=step_results(2, 3))]
    _advance(ctl, Running)
    assert [(r.cause, r.lost_steps) for r in ctl.recoveries] == [("node_lost", 0)]
    assert ctl.dp_history == [[0, 4], [1, 3]]


class _Clock:
    def __init__(self, now: float):
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_recovery_times_and_lost_steps_known_answer(tmp_path):
    """detect_s, recover_s, downtime_s and lost_steps against a scripted timeline on the
    driver's clock: rank 3 last answered at t=100.0, the loss was diagnosed at t=100.4, and
    the first step at the new size reached the driver at t=101.5. The survivors report step
    3 done while draining (their snapshots cover step 2 only), so one step is lost."""
    ctl = _controller(tmp_path)
    clock = _Clock(90.0)
    ctl.clock = clock
    _advance(ctl, Running)
    ctl.group.script = [Observation(results=step_results(1, 4) + step_results(2, 4))]
    _advance(ctl, Running)
    for m in ctl.group.members:
        m.last_ok, m.step = 100.0, 2
    clock.now = 100.4
    ctl.group.script = [Observation(failure=NodeLost("gone", ranks=[3], nodes=["n3"]))]
    state = _advance(ctl, Recovering)
    assert (state.failed_at, state.detected_at) == (100.0, 100.4)
    ctl.group.capacity = 3
    ctl.group.snapshot_step = 2
    ctl.group.drain_progress = {0: 3, 1: 3, 2: 3}
    _advance(ctl, Running)
    assert ctl.step == 2 and ctl.recoveries == []
    clock.now = 101.5
    ctl.group.script = [Observation(results=step_results(3, 3))]
    _advance(ctl, Running)
    (rec,) = ctl.recoveries
    assert rec.cause == "node_lost"
    assert rec.detect_s == pytest.approx(0.4, abs=1e-9)
    assert rec.recover_s == pytest.approx(1.1, abs=1e-9)
    assert rec.downtime_s == pytest.approx(1.5, abs=1e-9)
    assert rec.downtime_s == pytest.approx(rec.detect_s + rec.recover_s, abs=1e-9)
    assert rec.lost_steps == 1


def test_recovery_without_lost_work_counts_zero_steps(tmp_path):
    ctl = _controller(tmp_path)
    clock = _Clock(10.0)
    ctl.clock = clock
    _advance(ctl, Running)
    ctl.group.script = [Observation(results=step_results(1, 4))]
    _advance(ctl, Running)
    for m in ctl.group.members:
        m.last_ok, m.step = 10.0, 1
    clock.now = 10.25
    ctl.group.script = [Observation(failure=NodeLost("gone", ranks=[1], nodes=["n1"]))]
    _advance(ctl, Recovering)
    ctl.group.capacity = 3
    ctl.group.snapshot_step = 1
    _advance(ctl, Running)
    clock.now = 11.0
    ctl.group.script = [Observation(results=step_results(2, 3))]
    _advance(ctl, Running)
    (rec,) = ctl.recoveries
    assert (rec.lost_steps, rec.detect_s, rec.recover_s, rec.downtime_s) == (0, 0.25, 0.75, 1.0)


def test_a_failure_during_a_recovery_is_the_same_outage(tmp_path):
    """Rank 3's node dies at t=10.0; while the survivors re-form (t=10.5) rank 2's node dies
    too; the first step at dp 2 lands at t=12.0. One outage, counted once from t=10.0."""
    ctl = _controller(tmp_path)
    clock = _Clock(5.0)
    ctl.clock = clock
    _advance(ctl, Running)
    for m in ctl.group.members:
        m.last_ok, m.step = 10.0, 0
    clock.now = 10.25
    ctl.group.script = [Observation(failure=NodeLost("gone", ranks=[3], nodes=["n3"]))]
    _advance(ctl, Recovering)
    ctl.group.capacity = 3
    ctl.group.snapshot_step = 0
    ctl.group.configure_failures = [NodeLost("gone too", ranks=[2], nodes=["n2"])]
    clock.now = 10.5
    _advance(ctl, Recovering)  # the configure of dp 3 lost rank 2: recover again
    ctl.group.capacity = 2
    _advance(ctl, Running)
    assert ctl.recoveries == [] and ctl.group.dp == 2
    clock.now = 12.0
    ctl.group.script = [Observation(results=step_results(1, 2))]
    _advance(ctl, Running)
    (rec,) = ctl.recoveries
    assert (rec.failures, rec.cause, rec.downtime_s, rec.detect_s) == (2, "node_lost", 2.0, 0.25)
    assert ctl.failures == 2


def test_worker_error_retries_in_place_without_eviction(tmp_path):
    ctl = _controller(tmp_path)
    _advance(ctl, Running)
    ctl.group.script = [Observation(failure=WorkerError("boom", ranks=[1]))]
    _advance(ctl, Recovering)
    ctl.group.snapshot_step = 0
    _advance(ctl, Running)
    assert not any(c[0] == "kill" and c[1] for c in ctl.group.calls)
    assert ctl.group.dp == 4
    assert not [e for e in read_events(str(tmp_path)) if e["kind"] == "resize"]


def test_failure_budget_exhausted(tmp_path):
    ctl = _controller(tmp_path, spec=_spec(max_failures=1))
    _advance(ctl, Running)
    for expected in (Running, Failed):
        ctl.group.script = [Observation(failure=WorkerError("boom", ranks=[0]))]
        _advance(ctl, Recovering)
        ctl.group.snapshot_step = 0
        _advance(ctl, expected)
    assert "failure budget exhausted" in ctl.state.reason


def test_no_capacity_for_min_dp_fails_with_reason(tmp_path):
    ctl = _controller(tmp_path, spec=_spec(min_dp=2))
    _advance(ctl, Running)
    ctl.group.script = [Observation(failure=NodeLost("gone", ranks=[0, 1, 2], nodes=["a", "b", "c"]))]
    _advance(ctl, Recovering)
    ctl.group.capacity = 1
    _advance(ctl, Failed)
    assert "min_dp=2" in ctl.state.reason


def test_returned_capacity_grows_back(tmp_path):
    ctl = _controller(tmp_path, capacity=2)
    _advance(ctl, Running)
    assert ctl.group.dp == 2
    ctl.group.capacity = 4
    ctl.group.snapshot_step = 0
    ctl._last_grow_check = 0.0
    state = _advance(ctl, Resizing)
    assert len(state.groups) == 2
    _advance(ctl, Running)
    assert ctl.group.dp == 4 and ("request_stop",) in ctl.group.calls
    assert ctl.dp_history[-1] == [0, 4]


def test_the_controller_keeps_watching_while_a_grow_backs_workers_start(tmp_path):
    """A grow-back's new workers start while the job trains on, and the controller does not
    wait for them: steps are still collected meanwhile, and the resize comes once they have
    started, with them as its newcomers (no second spawn)."""
    ctl = _controller(tmp_path, capacity=2)
    _advance(ctl, Running)
    ctl.group.capacity, ctl.group.snapshot_step, ctl._last_grow_check = 4, 1, 0.0
    ctl.group.starting_polls = 2
    ctl.group.script = [Observation(results=step_results(1, 2))]
    _advance(ctl, Running)  # the start begun; step 1 collected
    assert ("spawn_begin", 2) in ctl.group.calls and ctl.step == 1 and ctl._growing is not None
    _advance(ctl, Running)  # still starting
    state = _advance(ctl, Resizing)
    assert len(state.ahead) == 2 and state.not_started is None and ctl._growing is None
    _advance(ctl, Running)
    assert ctl.group.dp == 4 and all(any(m is n for n in ctl.group.members) for m in state.ahead)
    assert [c[0] for c in ctl.group.calls].count("spawn") == 1  # the start's only: the resize spawned none
    assert ("spawn_cancel", 2) not in ctl.group.calls


def test_a_failure_while_a_grow_backs_workers_start_cancels_them(tmp_path):
    """The failure is seen while the new workers start (the controller did not wait for
    them); they are killed before anything else happens, and the job's end is reached."""
    ctl = _controller(tmp_path, spec=_spec(max_failures=0), capacity=2)
    _advance(ctl, Running)
    ctl.group.capacity, ctl.group.snapshot_step, ctl._last_grow_check = 4, 0, 0.0
    ctl.group.starting_polls = 1000
    ctl.group.script = [Observation(), Observation(failure=NodeLost("gone", ranks=[1], nodes=["b"]))]
    with pytest.raises(JobFailed):  # max_failures 0: the failure ends the job
        ctl.run()
    calls = ctl.group.calls
    assert ("spawn_cancel", 2) in calls and ctl._growing is None
    assert calls.index(("spawn_begin", 2)) < calls.index(("spawn_cancel", 2))
    assert ("spawn_end", 2) not in calls


def test_a_grow_back_whose_workers_did_not_start_is_met_at_the_boundary(tmp_path):
    ctl = _controller(tmp_path, capacity=2)
    _advance(ctl, Running)
    ctl.group.capacity, ctl.group.snapshot_step, ctl._last_grow_check = 4, 0, 0.0
    ctl.group.start_failure = ActorDied("a new worker was lost while starting: ActorDiedError", ranks=[], nodes=[])
    state = _advance(ctl, Resizing)
    assert state.ahead == [] and isinstance(state.not_started, ActorDied) and ctl._growing is None
    _advance(ctl, Recovering)  # as before: the failure is met once the job stands at a boundary


def test_run_raises_job_failed_with_result(tmp_path):
    ctl = _controller(tmp_path, spec=_spec(max_failures=0))
    ctl.group.script = [Observation(failure=WorkerError("boom", ranks=[0]))]
    with pytest.raises(JobFailed) as info:
        ctl.run()
    assert info.value.result.status == "failed" and info.value.result.failures == 1
    assert read_events(str(tmp_path))[-1]["kind"] == "job_end"
