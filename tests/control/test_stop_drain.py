"""Stop and shrink on notice, on the real 4-node local cluster (one worker per node).

* SIGTERM / SIGINT to a real ``elastic run`` process: it stops at the next step boundary,
  commits a verified checkpoint of that step, exits 143 / 130 with ``status: stopped``, and
  ``--resume`` goes on from there with 0 lost steps and the losses of a run never stopped.
* A node drained through Ray's own API (``GcsClient.drain_node``) with a 30 s deadline:
  the job shrinks at the next step boundary before the deadline, with no ``failure`` event
  and 0 lost steps, then grows back once a node is offered again.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time

import pytest
import yaml
from elastic_testlib import REL_SAME_ORDER, STEPS, assert_matches_reference, elastic_spec, events_of, step_metrics
from waiting import wait_until

from elastic import ElasticTrainer
from elastic.control.callbacks import Callback
from elastic.events import read_events
from elastic.faults import Fault, FaultInjector, WorkerFaults, worker_fault

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(400)]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SLOW_S = 0.25  # rank 0 works this much longer before every step (a busy loop): a signal lands mid-run
PACE_S = 0.05  # the drain tests: every rank works this much more per step (steps in flight, not a race to the end)


def _spec_file(tmp_path, ckpt_uri: str) -> str:
    """``elastic_spec()`` (the reference's model, data and batch) at dp up to 4, with a
    storage tier that writes nothing on its own before the last step (every 1000 steps):
    the checkpoint a stop leaves is the stop's own."""
    spec = elastic_spec(min_dp=1, max_dp=4)
    raw = spec.model_dump(mode="json", by_alias=True, exclude_none=True)
    raw["checkpoint"].update({"every_steps": 1000, "uri": ckpt_uri})
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def _start(spec_file: str, run_dir: str, address: str, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": ROOT}
    cmd = [sys.executable, "-m", "jobs.cli", "run", spec_file, "--address", address, "--run-dir", run_dir, *extra]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _steps_done(run_dir: str) -> int:
    try:
        return max((e["step"] for e in read_events(run_dir) if e["kind"] == "step"), default=0)
    except (OSError, json.JSONDecodeError):
        return 0


def _signal_at(proc: subprocess.Popen, run_dir: str, step: int, sig: int) -> float:
    wait_until(lambda: _steps_done(run_dir) >= step or proc.poll() is not None, timeout=240, what=f"step {step}")
    assert proc.poll() is None, proc.communicate()[1][-3000:]
    t = time.time()
    proc.send_signal(sig)
    return t


def _no_job_actors_left(job_hex: str | None = None) -> None:
    import ray

    def clean() -> bool:
        actors = ray._private.state.state.actor_table(None)
        alive = [a for a in actors.values() if a["State"] != "DEAD" and a["ActorClassName"] == "TrainWorker"]
        groups = [g for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED"]
        return not alive and not groups

    wait_until(clean, timeout=60, what="no TrainWorker actor and no placement group left")


def test_sigterm_stops_checkpoints_and_resumes(ray_cluster, reference_losses_cluster, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    spec_file = _spec_file(tmp_path, ckpt)
    first, second = str(tmp_path / "first"), str(tmp_path / "second")
    proc = _start(spec_file, first, ray_cluster.address, "--fault", f"slow@1:rank=0:seconds={SLOW_S}")
    t_signal = _signal_at(proc, first, 4, signal.SIGTERM)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 143, err[-3000:]
    summary = json.load(open(os.path.join(first, "summary.json")))
    end = events_of(first, "job_end")[-1]
    steps = summary["steps"]
    assert summary["status"] == end["status"] == "stopped"
    assert summary["stop"]["signal"] == end["signal"] == "SIGTERM"
    assert summary["stop"]["checkpoint_step"] == end["checkpoint_step"] == steps == _steps_done(first)
    ckpts = [e for e in events_of(first, "checkpoint") if e["tier"] == "storage"]
    assert [(c["step"], c["committed"]) for c in ckpts] == [(steps, True)]
    step_times = [e["step_time_s"] for e in events_of(first, "step")]
    stop_s = end["ts"] - t_signal
    bound = max(step_times) + ckpts[0]["duration_s"]
    print(
        f"SIGTERM at step {steps - 1}..{steps}: job_end {stop_s:.2f}s after the signal; one step "
        f"{statistics.median(step_times):.2f}s (max {max(step_times):.2f}s) + checkpoint {ckpts[0]['duration_s']:.2f}s"
    )
    # One step plus the checkpoint, plus the driver's own round trips (stop request, polls,
    # commit thread: a few 0.1 s polls) on a loaded 2-core machine.
    assert stop_s <= bound + 3.0, f"stop took {stop_s:.2f}s > one step + checkpoint {bound:.2f}s + 3s"
    assert "SIGTERM: stopping at the next step boundary" in err and "committed and verified" in err
    _no_job_actors_left()
    # The checkpoint verifies with the CLI too.
    check = subprocess.run(
        [sys.executable, "-m", "jobs.cli", "ckpt", "verify", ckpt, "--step", str(steps)],
        env={**os.environ, "PYTHONPATH": ROOT},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert check.returncode == 0, check.stderr

    proc = _start(spec_file, second, ray_cluster.address, "--resume")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    restore = events_of(second, "restore")[0]
    assert (restore["source"], restore["step"]) == ("storage", steps)  # 0 lost steps
    resumed = step_metrics(second)
    assert min(resumed) == steps + 1
    got = {**step_metrics(first), **resumed}
    assert_matches_reference(got, reference_losses_cluster, rel=REL_SAME_ORDER, steps=STEPS)


def test_sigint_exits_130_and_a_second_signal_stops_at_once(ray_cluster, tmp_path):
    """The first SIGINT comes once step 5 is done, while rank 0 hangs before step 6 (its peers
    wait in the step's all-reduce): the graceful stop cannot end before the hang does, so the
    second SIGINT, sent once the first is acknowledged, always finds it in progress. The hang
    (30 s) outlasts the heartbeat timeout (4 s): the second signal comes well before that."""
    spec_file = _spec_file(tmp_path, str(tmp_path / "ckpt"))
    run_dir = str(tmp_path / "run")
    faults = ("--fault", f"slow@1:rank=0:seconds={SLOW_S}", "--fault", "hang@6:rank=0:seconds=30")
    proc = _start(spec_file, run_dir, ray_cluster.address, *faults)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
    reader.start()
    _signal_at(proc, run_dir, 5, signal.SIGINT)
    # Two signals that arrive before the driver's main thread runs are one (Python keeps a
    # flag per signal, not a count): send the second once the first was acknowledged.
    wait_until(lambda: any("stopping at the next step boundary" in x for x in lines), 60, "the first SIGINT")
    t_second = time.time()
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=120)
    reader.join(timeout=30)
    err = "".join(lines)
    assert proc.returncode == 130, err[-3000:]
    summary = json.load(open(os.path.join(run_dir, "summary.json")))
    end = events_of(run_dir, "job_end")[-1]
    assert summary["status"] == end["status"] == "stopped" and end["signal"] == "SIGINT"
    assert end["checkpoint_step"] is None and "second signal" in end["stop_reason"]
    assert "stopped without a checkpoint" in err
    print(f"second SIGINT: job_end {end['ts'] - t_second:.2f}s after it")
    assert end["ts"] - t_second < SLOW_S + 2.0
    _no_job_actors_left()


class _MarkReturnDue(Callback):
    """Creates ``marker`` once the drained node's return is due: placed before the injector,
    so the ranks hold while the injector's ``add_node`` runs (seconds, on the main thread),
    not only once it has returned (by then the paced steps at dp 3 may all be done: seen in
    a clean-clone run, where ``add_node`` took 4.5 s and the run ended at dp 3)."""

    def __init__(self, injector: FaultInjector, marker: str, return_after_s: float):
        self.injector, self.marker, self.return_after_s = injector, marker, return_after_s

    def after_step(self, step, group) -> None:
        # A margin past the injector's own due time (taken just after ``drained``'s): a hold
        # begun before its return was due would stop the steps whose callbacks return it.
        due = self.injector.drained and time.time() >= self.injector.drained[0][0] + self.return_after_s + 0.25
        if due and not os.path.exists(self.marker):
            open(self.marker, "w").close()


def training_gap(run_dir: str, before_ts: float) -> tuple[float, float]:
    """(the gap between the last step done before ``before_ts`` and the next step, the
    median gap between consecutive steps elsewhere), from the step events' times."""
    ts = sorted(e["ts"] for e in events_of(run_dir, "step"))
    gaps = [b - a for a, b in zip(ts, ts[1:])]
    i = max(k for k, t in enumerate(ts) if t <= before_ts)
    return ts[i + 1] - ts[i], statistics.median(gaps[:i] + gaps[i + 1 :])


def test_drain_shrinks_at_a_boundary_then_grows_back(ray_cluster, reference_losses_cluster, tmp_path):
    # No failure is expected at all: a long heartbeat keeps a loaded machine's slow poll
    # answer (the paced ranks burn CPU) from being taken for a hung rank.
    spec = elastic_spec(min_dp=1, max_dp=4, grow_check_s=0.5, heartbeat_timeout_s=30)
    # The node comes back 1 s after the notice: while the paced steps at dp 3 still run (the
    # 24 steps after the drain take some seconds), then the holds keep the run from ending
    # before it grows back.
    injector = FaultInjector(
        [Fault("drain", at_step=8, node_index=3, deadline_s=30.0, return_after_s=1.0)],
        cluster=ray_cluster,
        node_args={"num_cpus": 1},
    )
    marker = str(tmp_path / "node-returned")
    faults = [worker_fault("slow", step=1, rank=r, seconds=PACE_S) for r in range(4)]
    faults += [worker_fault("hold", step=1, rank=r, seconds=120, marker=marker, below_dp=4) for r in range(4)]
    run_dir = str(tmp_path / "run")
    callbacks = [_MarkReturnDue(injector, marker, 1.0), injector]
    result = ElasticTrainer(spec, run_dir=run_dir, callbacks=callbacks, step_hook=WorkerFaults(faults)).fit()
    assert result.status == "succeeded"
    assert events_of(run_dir, "failure") == [] and result.failures == 0 and result.recoveries == []
    resizes = events_of(run_dir, "resize")
    drain = resizes[0]
    assert (drain["reason"], drain["old_dp"], drain["new_dp"], drain["lost_steps"]) == ("drain", 4, 3, 0)
    assert drain["at_once"] is False and "drain_reason" in drain
    drained_at = injector.drained[0][0]
    assert drain["ts"] - drained_at < 30.0, "shrank after the deadline"
    assert resizes[-1]["new_dp"] == 4 and resizes[-1]["reason"] == "capacity returned"
    # grow-back went to the node offered again, never to the one still draining
    drained_node = injector.drained[0][1]
    later = [e for e in events_of(run_dir, "placement") if e["ts"] > drain["ts"]]
    assert later and all(r["node_id"] != drained_node for e in later for r in e["ranks"])
    restores = events_of(run_dir, "restore")
    assert restores[0]["source"] == "memory"
    gap, ordinary = training_gap(run_dir, drain["ts"])
    print(
        f"drain: notice to resize {drain['ts'] - drained_at:.2f}s (deadline 30s), re-form {drain['reform_s']:.2f}s, "
        f"training gap {gap:.2f}s vs ordinary step gap {ordinary:.2f}s"
    )
    assert gap <= ordinary + drain["reform_s"] + 1.0
    assert_matches_reference(step_metrics(run_dir), reference_losses_cluster, rel=REL_SAME_ORDER, steps=STEPS)


def test_drain_with_a_near_deadline_drops_the_replica_at_once(ray_cluster, reference_losses_cluster, tmp_path):
    """A 1 s notice is too short to finish the step in flight: the drained worker is dropped
    at once and the survivors restore the previous step's snapshot, still without a failure."""
    spec = elastic_spec(min_dp=1, max_dp=4)
    injector = FaultInjector(
        [Fault("drain", at_step=8, node_index=3, deadline_s=1.0)], cluster=ray_cluster, node_args={"num_cpus": 1}
    )
    faults = [worker_fault("slow", step=1, rank=r, seconds=PACE_S) for r in range(4)]
    run_dir = str(tmp_path / "run")
    result = ElasticTrainer(spec, run_dir=run_dir, callbacks=[injector], step_hook=WorkerFaults(faults)).fit()
    assert result.status == "succeeded"
    assert events_of(run_dir, "failure") == [] and result.failures == 0
    drain = events_of(run_dir, "resize")[0]
    assert (drain["reason"], drain["old_dp"], drain["new_dp"], drain["at_once"]) == ("drain", 4, 3, True)
    print(f"drain at once: lost_steps {drain['lost_steps']}, re-form {drain['reform_s']:.2f}s")
    assert drain["lost_steps"] <= 1  # at most the step in flight when the replica was dropped
    assert events_of(run_dir, "restore")[0]["source"] == "memory"
    assert_matches_reference(step_metrics(run_dir), reference_losses_cluster, rel=REL_SAME_ORDER, steps=STEPS)
