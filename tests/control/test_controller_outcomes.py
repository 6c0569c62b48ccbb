"""How a run ends when retrying cannot help, on the controller over the scripted fake group:
a worker group that cannot start, an error that a retry would repeat, a final storage
checkpoint that was not committed (DESIGN §10). And the one line a configure error becomes."""

from __future__ import annotations

import os
import signal
import time

import pytest
from fake_group import FakeWorkerGroup, step_results
from ray.exceptions import RayTaskError

from elastic.checkpoint.committer import CheckpointCommitter
from elastic.control.controller import Controller, Failed, Finished, Recovering, Running, Starting
from elastic.control.controller.states import stopped_state
from elastic.control.stop import StopSignals, exit_code_of
from elastic.control.worker_group.api import Observation
from elastic.control.worker_group.configure import root_cause
from elastic.errors import JobFailed, NodeLost, NotRetryable, RendezvousFailed, WorkerError
from elastic.events import EventLog, read_events
from jobs import JobSpec
from storage.errors import LayoutMismatch

pytestmark = pytest.mark.timeout(60)


class _Controller(Controller):
    worker_group_cls = FakeWorkerGroup


def _controller(tmp_path, storage_uri: str = "", every_steps: int = 0):
    spec = JobSpec.from_dict(
        {
            "model": {"n_layers": 2, "d_model": 32, "n_heads": 4, "vocab_size": 64, "seq_len": 16},
            "parallel": {"micro_batch": 1},
            "elastic": {"min_dp": 1, "max_dp": 2, "max_failures": 3, "min_dp_wait_s": 1},
            "train": {"steps": 2, "global_batch": 4},
            "checkpoint": {"every_steps": every_steps},
        }
    )
    return _Controller(spec, EventLog(str(tmp_path / "run")), "memory://corpus", storage_uri=storage_uri)


def _advance(ctl, expected):
    ctl.state = ctl._step(ctl.state)
    assert type(ctl.state) is expected, f"expected {expected.__name__}, got {type(ctl.state).__name__}"
    return ctl.state


def _failures(tmp_path):
    return [e for e in read_events(str(tmp_path / "run")) if e["kind"] == "failure"]


def test_a_configure_error_is_one_line_naming_the_workers_exception():
    """Ray wraps a worker's exception in a RayTaskError whose text is Ray's header and the
    remote traceback; what the user sees is the real exception, on one line."""
    inner = LayoutMismatch("app/model/tok_emb.weight: target shape (64, 64)\n != saved (64, 32)")
    wrapped = RayTaskError("configure", "Traceback (most recent call last):\n  ...", inner).as_instanceof_cause()
    assert root_cause(wrapped) == "LayoutMismatch: app/model/tok_emb.weight: target shape (64, 64) != saved (64, 32)"
    assert root_cause(ValueError("plain")) == "ValueError: plain"


def test_a_group_that_cannot_start_fails_with_the_cause_in_its_failure_event(tmp_path):
    ctl = _controller(tmp_path)
    detail = "configure failed: LayoutMismatch: app/model/tok_emb.weight: target shape (64, 64) != saved (64, 32)"
    ctl.group.configure_failures = [WorkerError(detail, ranks=[0, 1])]
    state = _advance(ctl, Failed)
    assert state.reason == f"could not start the worker group: worker_error: {detail}"
    (failure,) = _failures(tmp_path)
    assert failure["detail"] == detail and failure["ranks"] == [0, 1] and ctl.failures == 1


def test_a_start_the_machines_failed_begins_again_keeping_the_workers_that_answered(tmp_path):
    """A rendezvous that timed out or a node lost while the group starts is not the training
    code's fault: the start begins again (within elastic.max_failures, 3 here), each try a
    failure event. The workers that answered are kept; those that did not (maybe stuck in
    the old rendezvous) and the lost are replaced. The code's own error is not retried."""
    timed_out = "configure failed: DistStoreError: wait timeout after 6000ms, keys: /gen1/rank1"
    silent = RendezvousFailed("configure failed: GetTimeoutError: no answer from 1 rank(s) on 1 node(s)", [1])
    silent.unanswered = [1]
    ctl = _controller(tmp_path)
    lost = NodeLost("lost while reconfiguring", ranks=[0])
    ctl.group.configure_failures = [RendezvousFailed(timed_out, ranks=[0, 1]), silent, lost]
    _advance(ctl, Starting)  # every rank answered: all kept
    first = list(ctl.group.members)
    assert not any(m.dead for m in first) and not [c for c in ctl.group.calls if c[0] in ("kill", "release")]
    _advance(ctl, Starting)  # the same workers tried again, none spawned; rank 1 never answered
    assert [c[0] for c in ctl.group.calls].count("spawn") == 1
    assert first[1].dead and not first[0].dead and ("kill", [1]) in ctl.group.calls
    assert [c for c in ctl.group.calls if c[0] == "release"] == [("release", first[1].group)]
    _advance(ctl, Starting)  # rank 0 kept, rank 1 new; then rank 0 lost
    assert [c[0] for c in ctl.group.calls].count("spawn") == 2 and first[0].dead
    second = ctl.group.members[1]
    assert ctl.group.members[0] is first[0] and second not in first
    _advance(ctl, Running)
    assert [c[0] for c in ctl.group.calls].count("spawn") == 3 and ctl.failures == 3
    assert ctl.group.members[0] is second and ctl.group.dp == 2
    assert [(f["cause"], f["detail"]) for f in _failures(tmp_path)] == [
        ("worker_error", timed_out),
        ("worker_error", silent.detail),
        ("node_lost", "lost while reconfiguring"),
    ]
    # The budget bounds the tries: the fourth failure is one too many.
    ctl = _controller(tmp_path / "budget")
    ctl.group.configure_failures = [RendezvousFailed(timed_out, ranks=[0]) for _ in range(4)]
    for _ in range(3):
        _advance(ctl, Starting)
    state = _advance(ctl, Failed)
    assert state.reason == f"could not start the worker group: worker_error: {timed_out}"
    assert ctl.failures == 4


def test_an_error_a_retry_would_repeat_fails_the_job_at_once(tmp_path):
    ctl = _controller(tmp_path)
    _advance(ctl, Running)
    before = len(ctl.group.calls)
    bad = "CorpusError: /data batch 3: token ids from 0 to 900; model.vocab_size 64 allows 0..63"
    ctl.group.script = [Observation(failure=NotRetryable(bad, ranks=[1]))]
    _advance(ctl, Recovering)
    state = _advance(ctl, Failed)  # max_failures is 3: the budget is not what stopped it
    assert state.reason == f"worker_error that a retry would repeat: {bad}"
    assert ctl.failures == 1 and [f["cause"] for f in _failures(tmp_path)] == ["worker_error"]
    assert not [c for c in ctl.group.calls[before:] if c[0] in ("spawn", "reform")]  # no re-formation tried


def test_a_final_checkpoint_not_committed_fails_the_job_naming_the_cause(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    for every_steps, expected in ((0, Finished), (2, Failed)):
        ctl = _controller(tmp_path / f"every{every_steps}", storage_uri=ckpt, every_steps=every_steps)
        assert isinstance(ctl.committer, CheckpointCommitter)
        _advance(ctl, Running)
        # the committer's record of the final step's upload errors (what the ranks reported)
        ctl.committer.failures.append({"step": 2, "cause": "rank 0: OSError: [Errno 30] Read-only file system"})
        ctl.group.script = [Observation(results=step_results(1, 2) + step_results(2, 2), finished=True)]
        state = _advance(ctl, expected)  # no storage tier (every_steps 0): nothing to wait for
    assert state.reason == (
        "the final checkpoint (step 2) could not be committed to storage: "
        "rank 0: OSError: [Errno 30] Read-only file system"
    )
    with pytest.raises(JobFailed) as info:
        ctl._finish(1.0)
    assert info.value.result.checkpoint_failures == [
        {"step": 2, "cause": "rank 0: OSError: [Errno 30] Read-only file system"}
    ]


def test_a_node_whose_disk_fails_its_ranks_is_excluded_not_retried_until_the_budget_ends(tmp_path):
    """Re-formations in place that fail on one node's full disk (``NodeResourceError``, a
    ``worker_error`` with ``node_fault``) count against that node: after
    ``elastic.lemon_failures`` (2) it is excluded, where before every retry met the same disk
    until the failure budget ran out."""
    from elastic.errors import NodeResourceError

    ctl = _controller(tmp_path)
    _advance(ctl, Running)
    n1 = ctl.group.members[-1].node_id
    full = [NodeResourceError("configure failed: OutOfDiskError: disk full", ranks=[1], nodes=[n1]) for _ in range(2)]
    ctl.group.script = [Observation(failure=WorkerError("ValueError: bad", ranks=[0]))]
    ctl.group.configure_failures = full
    for _ in range(8):
        if [c for c in ctl.group.calls if c[0] == "exclude"] or isinstance(ctl.state, Failed):
            break
        ctl.state = ctl._step(ctl.state)
    failures = _failures(tmp_path)
    assert [f.get("node_fault", False) for f in failures] == [False, True, True]
    excluded = [e for e in read_events(str(tmp_path / "run")) if e["kind"] == "node_excluded"]
    assert [e["node_id"] for e in excluded] == [n1] and ("exclude", [n1]) in ctl.group.calls


def test_a_configure_that_a_node_failed_raises_the_node_typed_error():
    """``reconfigure_ranks``: when a node's agent names failed calls as its own fault (a full
    disk), the failure is a ``NodeResourceError`` naming that node's ranks alone; a rank's own
    error elsewhere stays a plain ``WorkerError``."""
    from types import SimpleNamespace

    from elastic.control.worker_group.configure import reconfigure_ranks
    from elastic.control.worker_group.poll import Gather
    from elastic.errors import NodeResourceError
    from elastic.messages import CommandDone

    def group(done: dict[str, CommandDone]):
        def command(parts, expect):
            g = Gather(1, parts, expect)
            for node, d in done.items():
                g.add(node, d)
            return g

        return SimpleNamespace(
            command=command, wait_for=lambda *a, **k: None, done=lambda g: None,
            tree=SimpleNamespace(send=lambda parts: None),
        )  # fmt: skip

    members = [SimpleNamespace(rank=r, wid=r, node_id=f"n{r}", since=0) for r in range(2)]
    full = {
        "n0": CommandDone(1, {}, {0: "ValueError: bad"}),
        "n1": CommandDone(1, {}, {1: "OutOfDiskError: full"}, node_faults=(1,)),
    }
    with pytest.raises(NodeResourceError) as err:
        reconfigure_ranks(group(full), members, ["req0", "req1"], 3, 1.0, None, [])
    assert err.value.ranks == [1] and err.value.nodes == ["n1"] and "OutOfDiskError" in err.value.detail
    own = {"n0": CommandDone(1, {}, {0: "ValueError: bad"}), "n1": CommandDone(1, {1: "its reply"})}
    with pytest.raises(WorkerError) as err:
        reconfigure_ranks(group(own), members, ["req0", "req1"], 3, 1.0, None, [])
    assert type(err.value) is WorkerError and err.value.ranks == [0]


def test_the_commit_thread_ends_with_the_job(tmp_path):
    """A job that submitted commits leaves no commit thread behind once it ends (a process
    that runs many jobs, a sweep's or a notebook's, kept one per job)."""
    from elastic.messages import UploadReport

    ctl = _controller(tmp_path, storage_uri=str(tmp_path / "ckpt"), every_steps=1)
    _advance(ctl, Running)
    ctl.committer.add(0, UploadReport(1, 0, (0, 1), {}, None, "OSError: disk full", 0.0, 0.0, 0.0, 0))
    thread = ctl.committer._thread
    assert thread is not None and thread.is_alive() and ctl.committer.join(10)
    ctl.group.script = [Observation(results=step_results(1, 2) + step_results(2, 2), finished=True)]
    with pytest.raises(JobFailed):  # the final step's checkpoint was never committed
        ctl.run()
    thread.join(10)
    assert not thread.is_alive()


def test_a_grow_back_waits_for_the_storage_checkpoint_in_flight(tmp_path):
    """Stopping the job drops the uploads in flight (a re-formation), so a grow-back waits
    until the storage checkpoint of its generation's latest due step has arrived."""
    from elastic.control.controller import Resizing
    from elastic.messages import UploadReport

    ctl = _controller(tmp_path, storage_uri=str(tmp_path / "ckpt"), every_steps=1)
    ctl.spec.train.steps = 5
    ctl.group.capacity = 1
    _advance(ctl, Running)  # dp 1
    ctl.group.capacity, ctl.group.snapshot_step, ctl._last_grow_check = 2, 1, 0.0
    ctl.group.script = [Observation(results=step_results(1, 1))]
    _advance(ctl, Running)  # step 1 (due for storage) collected, the new worker started: no resize yet
    _advance(ctl, Running)
    assert ctl.step == 1 and ctl._growing is not None and ("spawn_end", 1) not in ctl.group.calls
    ctl.committer.add(0, UploadReport(1, 0, (0, 1), {}, None, "OSError: disk full", 0.0, 0.0, 0.0, 0))
    state = _advance(ctl, Resizing)  # the upload arrived (here, to be recorded as not committed)
    assert len(state.ahead) == 1
    assert ctl.committer.join(10)
    ctl.committer.close()
    # Without a storage upload of this generation due, no wait.
    ctl = _controller(tmp_path / "none", storage_uri=str(tmp_path / "ckpt2"), every_steps=2)
    ctl.spec.train.steps = 5
    ctl.group.capacity = 1
    _advance(ctl, Running)
    ctl.group.capacity, ctl.group.snapshot_step, ctl._last_grow_check = 2, 1, 0.0
    ctl.group.script = [Observation(results=step_results(1, 1))]
    _advance(ctl, Resizing)


class _SignalledAtShutdown(FakeWorkerGroup):
    """The user's second Ctrl-C lands while the driver closes the group."""

    def shutdown(self):
        super().shutdown()
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.01)  # the handler runs in the main thread at the next bytecode


def test_a_signal_during_the_final_shutdown_keeps_the_stopped_result(tmp_path):
    """A graceful stop completed (checkpoint of step 5 committed); a second SIGINT arrives
    while the group is shut down. The job's end stands: status stopped, exit 130, the
    checkpoint reported, no traceback (before, ``StopNow`` escaped from the ``finally``)."""

    class Ctl(Controller):
        worker_group_cls = _SignalledAtShutdown

    signals = StopSignals(grace_s=30.0)
    assert signals.install()
    try:
        ctl = Ctl(_controller(tmp_path).spec, EventLog(str(tmp_path / "run")), "memory://corpus", stop_signals=signals)
        os.kill(os.getpid(), signal.SIGINT)  # the first: recorded, the stop is graceful
        time.sleep(0.01)
        assert signals.requested
        ctl.state = stopped_state(signals, 5, 5, "stopped at a step boundary")
        result = ctl.run()
    finally:
        signals.uninstall()
    assert ("shutdown",) in ctl.group.calls
    assert result.status == "stopped" and exit_code_of(result) == 130
    assert result.stop["checkpoint_step"] == 5


def test_a_storage_checkpoint_a_failure_cut_off_is_in_checkpoint_failures(tmp_path):
    """A failure's re-formation drops the uploads in flight: the step they were writing is
    recorded as not committed (with why) once the next generation wrote past it."""
    from elastic.messages import UploadReport

    ctl = _controller(tmp_path, storage_uri=str(tmp_path / "ckpt"), every_steps=1)
    ctl.spec.train.steps = ctl.committer.last_step = 5  # step 2 is not the final one
    _advance(ctl, Running)  # dp 2
    ctl.group.script = [Observation(results=step_results(1, 2))]
    _advance(ctl, Running)  # step 1 done, its uploads under way
    ctl.group.script = [Observation(failure=NodeLost("gone", ranks=[1], nodes=["n1"]))]
    _advance(ctl, Recovering)
    ctl.group.capacity, ctl.group.snapshot_step = 1, 1
    _advance(ctl, Running)  # dp 1 from step 1: step 1's uploads were dropped
    assert ctl.step == 1 and ctl.committer.failures == []
    replay = UploadReport(2, 0, (1, 1), {}, None, None, 0.0, 0.0, 0.0, 0, already_committed=True)
    ctl.group.script = [Observation(results=[*step_results(2, 1), (0, replay)])]
    _advance(ctl, Running)
    assert ctl.committer.join(10)
    assert ctl.committer.failures == [{"step": 1, "cause": "its uploads were cut off by a re-formation (node_lost)"}]
    ctl.committer.close()


class _Gcs:
    """A real port standing for the GCS's: listening until ``kill`` closes it (refused after)."""

    def __init__(self):
        import socket

        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"

    def kill(self):
        self.sock.close()


def _watching(tmp_path, gcs: _Gcs):
    from elastic.control.gcs_watch import GcsWatch

    class Watch(GcsWatch):
        @classmethod
        def of_this_driver(cls):
            return cls(gcs.address)

    class Ctl(_Controller):
        gcs_watch_cls = Watch

    spec = _controller(tmp_path).spec
    return Ctl(spec, EventLog(str(tmp_path / "run")), "memory://corpus")


def test_a_gcs_lost_mid_run_ends_the_job_failed_at_once_naming_it(tmp_path):
    """Issue 48, L21: the drain poll, the next GCS call, would wait for a killed GCS until Ray
    ends the driver (60 s, exit 1, no ``job_end``). The GCS's port is asked first: refused,
    the job fails within a poll, its end is written, and no Ray call is made to stop the
    workers (each would wait for the GCS too)."""
    gcs = _Gcs()
    ctl = _watching(tmp_path, gcs)
    _advance(ctl, Running)
    gcs.kill()
    started = time.monotonic()
    with pytest.raises(JobFailed) as info:
        ctl.run()
    assert time.monotonic() - started < 5
    reason = f"the Ray GCS at {gcs.address} is gone (its port refuses connections): "
    assert str(info.value) == reason + "Ray can no longer place, start or stop this job's workers"
    (end,) = [e for e in read_events(str(tmp_path / "run")) if e["kind"] == "job_end"]
    assert end["status"] == "failed" and end["reason"] == str(info.value)
    assert ("shutdown",) not in ctl.group.calls


def test_a_job_that_trained_to_its_end_ends_by_its_own_outcome_when_the_gcs_is_gone(tmp_path):
    gcs = _Gcs()
    ctl = _watching(tmp_path, gcs)
    _advance(ctl, Running)
    ctl.group.script = [Observation(results=step_results(1, 2) + step_results(2, 2), finished=True)]
    gcs.kill()
    result = ctl.run()
    assert result.status == "succeeded" and result.steps == 2
    (end,) = [e for e in read_events(str(tmp_path / "run")) if e["kind"] == "job_end"]
    assert end["status"] == "succeeded"
    assert ("shutdown",) not in ctl.group.calls  # it would wait for the GCS


def test_a_live_gcs_is_never_taken_for_lost(tmp_path):
    gcs = _Gcs()
    ctl = _watching(tmp_path, gcs)
    _advance(ctl, Running)
    ctl.group.script = [Observation(results=step_results(1, 2) + step_results(2, 2), finished=True)]
    assert ctl.run().status == "succeeded" and ("shutdown",) in ctl.group.calls
    assert ctl.gcs.lost() is None
    gcs.kill()


def test_a_loader_that_hangs_again_before_a_step_ends_the_job_naming_it(tmp_path):
    """Issue 48, L20: a hanging loader was a plain worker error, re-formed after every 60 s
    timeout until the failure budget was spent (11 tries, ~11 minutes). Now a loader stall
    is re-formed once (``LOADER_RETRIES``); stalling again before any step trains ends the
    job, one line naming the loader and the time waited. A step trained between starts the
    count again."""
    from elastic.errors import LoaderStalled

    detail = "LoaderTimeout: the native loader on host-a gave dp rank 0 no batch 2 within 60s"
    ctl = _controller(tmp_path)  # max_failures 3: the budget is not what ends it
    _advance(ctl, Running)
    ctl.group.script = [Observation(failure=LoaderStalled(detail, 60.0, [0, 1]))]
    _advance(ctl, Recovering)
    _advance(ctl, Running)  # the first stall: re-formed
    ctl.group.script = [Observation(results=step_results(1, 2)), Observation(failure=LoaderStalled(detail, 60.0, [0]))]
    _advance(ctl, Running)  # step 1 trained
    _advance(ctl, Recovering)
    _advance(ctl, Running)  # a stall after a trained step: the first again
    ctl.group.script = [Observation(failure=LoaderStalled(detail, 60.0, [0, 1]))]
    _advance(ctl, Recovering)
    state = _advance(ctl, Failed)
    assert state.reason == (
        f"the data loader hung: 2 stalls in a row after step {ctl.step}, no step trained between, "
        f"120s waited in all; the last: {detail}"
    )
    assert ctl.failures == 3
    assert [(f["cause"], f["loader_wait_s"]) for f in _failures(tmp_path)] == [("worker_error", 60.0)] * 3
