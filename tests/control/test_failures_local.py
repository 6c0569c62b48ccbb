"""Every failure cause on a real single-node Ray: detected, recovered in place, loss kept.

Each test runs the shared spec with one injected fault and compares the per-step losses
with the fault-free run of the same spec (same seed, global batch and data).
"""

from __future__ import annotations

import pytest
from elastic_testlib import (
    FAULT_STEP,
    REL_SAME_ORDER,
    STEPS,
    assert_matches_reference,
    elastic_spec,
    events_of,
    step_metrics,
)

from elastic import ElasticTrainer
from elastic.faults import Fault, FaultInjector, WorkerFaults, worker_fault

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]


def _run(tmp_path, spec, **kwargs):
    trainer = ElasticTrainer(spec, run_dir=str(tmp_path / "run"), **kwargs)
    result = trainer.fit()
    return trainer.run_dir, result


def _check_recovery(run_dir, result, cause, reference, max_lost=0):
    assert result.status == "succeeded" and result.steps == STEPS
    failures = events_of(run_dir, "failure")
    assert [f["cause"] for f in failures] == [cause]
    assert len(result.recoveries) == 1 and result.recoveries[0].cause == cause
    print("recoveries:", result.recoveries)
    assert result.recoveries[0].lost_steps <= max_lost
    assert events_of(run_dir, "restore"), "no restore event"
    # Same DP degree (2) as the fault-free run: the same reduction order throughout.
    assert_matches_reference(step_metrics(run_dir), reference, rel=REL_SAME_ORDER)
    return failures[0]


def test_worker_process_killed(ray_local, reference_losses, tmp_path):
    spec = elastic_spec(min_dp=2, max_dp=2)
    injector = FaultInjector([Fault("kill_worker", at_step=FAULT_STEP, rank=1)])
    run_dir, result = _run(tmp_path, spec, callbacks=[injector])
    failure = _check_recovery(run_dir, result, "actor_died", reference_losses)
    assert failure["ranks"] == [1]
    # The node is alive, so the replica is replaced in place: DP stays 2.
    assert all(e["dp"] == 2 for e in events_of(run_dir, "step"))
    # Detected by the failed collective or call, not by the heartbeat timeout (4 s here).
    assert result.recoveries[0].detect_s < spec.elastic.heartbeat_timeout_s


def test_stopped_worker_heartbeat_timeout(ray_local, reference_losses, tmp_path):
    spec = elastic_spec(min_dp=2, max_dp=2, heartbeat_timeout_s=2, collective_timeout_s=30)
    injector = FaultInjector([Fault("stop_worker", at_step=FAULT_STEP, rank=0)])
    try:
        run_dir, result = _run(tmp_path, spec, callbacks=[injector])
    finally:
        injector.close()
    failure = _check_recovery(run_dir, result, "heartbeat_timeout", reference_losses)
    assert failure["ranks"] == [0]


def test_hung_collective_times_out(ray_local, reference_losses, tmp_path):
    spec = elastic_spec(min_dp=2, max_dp=2, heartbeat_timeout_s=30, collective_timeout_s=3)
    faults = [worker_fault("hang", step=FAULT_STEP, rank=1, seconds=8)]
    run_dir, result = _run(tmp_path, spec, step_hook=WorkerFaults(faults))
    failure = _check_recovery(run_dir, result, "collective_timeout", reference_losses)
    assert failure["ranks"] == [1]


@pytest.mark.parametrize("kind,cause", [("nan", "nan_loss"), ("spike", "loss_spike"), ("bitflip", "loss_spike")])
def test_bad_loss_rolls_back(ray_local, reference_losses, tmp_path, kind, cause):
    spec = elastic_spec(min_dp=2, max_dp=2)
    faults = [worker_fault(kind, step=FAULT_STEP + 4, rank=0)]
    run_dir, result = _run(tmp_path, spec, step_hook=WorkerFaults(faults))
    _check_recovery(run_dir, result, cause, reference_losses)
    # The corrupted step was never committed: no step event carries a non-finite loss.
    assert all(e["loss"] is not None for e in events_of(run_dir, "step"))


def test_exception_in_step(ray_local, reference_losses, tmp_path):
    spec = elastic_spec(min_dp=2, max_dp=2)
    faults = [worker_fault("raise", step=FAULT_STEP, rank=1)]
    run_dir, result = _run(tmp_path, spec, step_hook=WorkerFaults(faults))
    failure = _check_recovery(run_dir, result, "worker_error", reference_losses)
    assert failure["ranks"] == [1] and "injected failure" in failure["detail"]


def test_skip_policy_skips_the_bad_batch(ray_local, tmp_path):
    spec = elastic_spec(min_dp=2, max_dp=2, on_bad_loss="skip")
    faults = [worker_fault("nan", step=FAULT_STEP, rank=0)]
    run_dir, result = _run(tmp_path, spec, step_hook=WorkerFaults(faults))
    assert result.status == "succeeded" and result.steps == STEPS
    failure = events_of(run_dir, "failure")[0]
    assert failure["cause"] == "nan_loss" and "skip batch 7" in failure["detail"]


def test_failure_budget_exhausted_exits_1(ray_local, tmp_path, tiny_spec_dict):
    import subprocess
    import sys

    import yaml

    raw = dict(tiny_spec_dict, elastic=dict(tiny_spec_dict["elastic"], max_failures=1, on_bad_loss="retry"))
    raw["train"] = dict(raw["train"], steps=12)
    config = tmp_path / "spec.yaml"
    config.write_text(yaml.safe_dump(raw))
    # Two NaN faults, one budgeted failure: the second ends the job.
    script = (
        "import sys; from jobs.cli import main; from elastic import api as trainer;"
        "from elastic.faults import WorkerFaults, worker_fault;"
        "orig = trainer.ElasticTrainer.__init__\n"
        "def init(self, spec, **kw):\n"
        "    kw['step_hook'] = WorkerFaults([worker_fault('nan', 4, 0), worker_fault('nan', 7, 0)])\n"
        "    orig(self, spec, **kw)\n"
        "trainer.ElasticTrainer.__init__ = init\n"
        f"sys.exit(main(['run', {str(config)!r}, '--run-dir', {str(tmp_path / 'run')!r}, "
        f"'--address', {ray_local.get_runtime_context().gcs_address!r}]))"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=200)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "failure budget exhausted" in proc.stderr
    summary = __import__("json").load(open(tmp_path / "run" / "summary.json"))
    assert summary["status"] == "failed" and summary["failures"] == 2


def test_fault_flag_from_the_command_line(ray_local, reference_losses, tmp_path):
    """``elastic run --fault``: a real SIGKILL of rank 1 after step 8, from the command line; the
    run finishes on the fault-free losses. The worker-side kinds the flag builds (``bitflip``
    included) run in ``test_bad_loss_rolls_back``. Open defect: a kill and a later bit flip in
    one run end with one extra ``collective_timeout`` at the last step (see the README)."""
    import subprocess
    import sys

    import yaml

    config = tmp_path / "spec.yaml"
    # Generous timeouts: on a loaded 2-core machine a 6 s collective timeout can fire by itself.
    spec = elastic_spec(min_dp=2, max_dp=2, heartbeat_timeout_s=20, collective_timeout_s=40)
    config.write_text(yaml.safe_dump(spec.model_dump(mode="json", by_alias=True)))
    run_dir = str(tmp_path / "run")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "jobs.cli",
            "run",
            str(config),
            "--run-dir",
            run_dir,
            "--fault",
            f"kill_worker@{FAULT_STEP}:rank=1",
            "--address",
            ray_local.get_runtime_context().gcs_address,
        ],
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    failures = events_of(run_dir, "failure")
    assert [(f["cause"], f["ranks"]) for f in failures] == [("actor_died", [1])], failures
    assert len(events_of(run_dir, "restore")) == 1
    summary = __import__("json").load(open(f"{run_dir}/summary.json"))
    assert summary["status"] == "succeeded" and summary["steps"] == STEPS and summary["failures"] == 1
    assert_matches_reference(step_metrics(run_dir), reference_losses, rel=REL_SAME_ORDER)
    # `elastic run` ends by writing the report and printing its path (docs/observability.md).
    report = f"{run_dir}/report/report.md"
    assert f"report            {report}" in proc.stdout and __import__("os").path.isfile(report), proc.stdout[-1000:]


def test_members_lost_mid_rendezvous_again_and_again(ray_local, reference_losses, tmp_path):
    """A member dies inside each of three re-formations in a row. The survivor waiting in
    each abandoned rendezvous is freed at once (the driver abandons the generation): it
    waits out neither ``collective_timeout_s`` nor the shorter rendezvous timeout, and the
    job finishes on the fault-free loss curve.

    The replacement is killed just before the driver sends the configure (no delay): a
    configure takes under 0.1 s now that survivors keep their state, so a kill some time
    after it began (0.3 s, before) landed in training instead, and in one CI run
    (2026-11-29) one of the three kills counted no failure at all."""
    from elastic.worker.process_group import ReconfigurableProcessGroup

    spec = elastic_spec(min_dp=2, max_dp=2, collective_timeout_s=120)
    rendezvous_s = ReconfigurableProcessGroup("cpu", 120).rendezvous_timeout.total_seconds()  # 30 s
    # Rank 1 of each new layout is the replacement just started (rank 0 keeps the snapshots).
    mid = [Fault("kill_worker", during_recovery=n, rank=1) for n in (1, 2, 3)]
    run_dir, result = _run(
        tmp_path, spec, callbacks=[FaultInjector([Fault("kill_worker", at_step=FAULT_STEP, rank=1)] + mid)]
    )
    assert result.status == "succeeded" and result.steps == STEPS
    failures = events_of(run_dir, "failure")
    assert len(failures) == 4 and all(f["cause"] == "actor_died" for f in failures), failures
    assert all("while reconfiguring" in f["detail"] for f in failures[1:]), failures  # not in training
    # From each mid-rendezvous kill to the failure it caused: the loss is seen and every
    # survivor has left the abandoned rendezvous.
    freed = [f["ts"] - (fault.fired_at + fault.delay_s) for fault, f in zip(mid, failures[1:])]
    print("kill -> survivors freed (s):", [round(x, 1) for x in freed])
    assert max(freed) < rendezvous_s / 2, freed
    assert_matches_reference(step_metrics(run_dir), reference_losses, rel=REL_SAME_ORDER)


def test_a_start_whose_rendezvous_times_out_begins_again(ray_local, reference_losses, tmp_path):
    """Rank 1 joins the job's first rendezvous later than rank 0 waits for it (a slow node
    at start-up, as a loaded machine gives): rank 0's rendezvous times out. That is no error
    of the training code, so the start begins again on the same workers (both answered), one
    failure spent, and the job trains the fault-free trajectory. (Before, the job failed at
    once: "could not start the worker group".)"""
    from elastic.worker.process_group import ReconfigurableProcessGroup

    spec = elastic_spec(min_dp=2, max_dp=2)
    timeout = spec.elastic.collective_timeout_s
    rendezvous_s = ReconfigurableProcessGroup("cpu", timeout).rendezvous_timeout.total_seconds()
    late = worker_fault("late", step=1, rank=1, seconds=rendezvous_s + 4)
    run_dir, result = _run(tmp_path, spec, step_hook=WorkerFaults([late]))
    assert result.status == "succeeded" and result.steps == STEPS
    (failure,) = events_of(run_dir, "failure")
    print(f"failure -> job_start: {events_of(run_dir, 'job_start')[0]['ts'] - failure['ts']:.2f} s")
    assert failure["cause"] == "worker_error" and "DistStoreError" in failure["detail"], failure
    assert not result.recoveries  # no training was lost: the start began again
    assert [e["dp"] for e in events_of(run_dir, "job_start")] == [2]
    assert_matches_reference(step_metrics(run_dir), reference_losses, rel=REL_SAME_ORDER)
