"""Faults that raise no error, injected from the CLI on a real 4-node local Ray cluster
(one worker per node): a straggler, a lemon node, a silent bit flip (docs/health.md)."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys

import pytest
import yaml
from elastic_testlib import STEPS, elastic_spec, events_of, step_metrics

from elastic import ElasticTrainer
from elastic.events import read_events

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(600)]


def _cli_run(tmp_path, name, spec, address, *faults):
    config = tmp_path / f"{name}.yaml"
    config.write_text(yaml.safe_dump(spec.model_dump(mode="json", by_alias=True)))
    run_dir = str(tmp_path / name)
    cmd = [sys.executable, "-m", "jobs.cli", "run", str(config), "--run-dir", run_dir, "--address", address]
    for f in faults:
        cmd += ["--fault", f]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir, json.load(open(f"{run_dir}/summary.json"))


def _api_run(tmp_path, name, spec):
    """A fault-free run through the Python API on the cluster this process is connected to
    (the same controller and workers as ``elastic run``, without a second interpreter's start)."""
    run_dir = str(tmp_path / name)
    result = ElasticTrainer(spec, run_dir=run_dir).fit()
    assert result.status == "succeeded" and result.steps == spec.train.steps
    return run_dir


def _spec(steps, **elastic):
    # Generous timeouts: this 2-core machine is shared, a short collective timeout fires by itself.
    spec = elastic_spec(heartbeat_timeout_s=30, collective_timeout_s=60, **elastic)
    spec.train.steps = steps
    return spec


def _step_before(run_dir, kind):
    """The step committed just before the first ``kind`` event."""
    step = 0
    for e in read_events(run_dir):
        if e["kind"] == "step":
            step = e["step"]
        if e["kind"] == kind:
            return step, e
    return None, None


def test_straggler_reported_within_5_steps_and_never_falsely(ray_cluster, tmp_path):
    """100 fault-free steps at dp 4: no straggler reported. Then rank 2 made slower by 30% of
    that run's median step time from step 10: reported within 5 steps, naming rank 2 and its node."""
    address = ray_cluster.address
    clean = _api_run(tmp_path, "clean", _spec(100, min_dp=4, max_dp=4))
    assert events_of(clean, "straggler") == []
    step_time = statistics.median(e["step_time_s"] for e in events_of(clean, "step")[10:])
    seconds = round(0.3 * step_time, 4)
    print(f"median step time {step_time * 1e3:.1f} ms: slow fault {seconds * 1e3:.1f} ms per step")
    slow, summary = _cli_run(
        tmp_path, "slow", _spec(30, min_dp=4, max_dp=4), address, f"slow@10:rank=2:seconds={seconds}"
    )
    assert summary["status"] == "succeeded"
    at, event = _step_before(slow, "straggler")
    assert event is not None, "straggler not reported"
    print("straggler event after step", at, event)
    assert event["ranks"] == [2] and len(event["nodes"]) == 1 and event["slowdown"] > 1.3
    assert 10 + 4 <= at <= 10 + 5  # five slow steps in a row (10..14); committed by step 15 at the latest
    assert len(events_of(slow, "straggler")) == 1  # one episode, one report


def test_straggler_evicted_and_its_node_excluded(ray_cluster, tmp_path):
    """``on_straggler: evict`` with ``lemon_failures: 1``: the slow node is evicted, DP goes
    4 -> 3, and the node, free again, is never used for this job."""
    spec = _spec(40, min_dp=1, max_dp=4, on_straggler="evict", lemon_failures=1, grow_check_s=0.5)
    run_dir, summary = _cli_run(tmp_path, "evict", spec, ray_cluster.address, "slow@5:rank=1:seconds=0.05")
    assert summary["status"] == "succeeded" and summary["steps"] == 40
    straggler = events_of(run_dir, "straggler")[0]
    failures = events_of(run_dir, "failure")
    assert [f["cause"] for f in failures] == ["straggler"] and failures[0]["nodes"] == straggler["nodes"]
    excluded = events_of(run_dir, "node_excluded")
    assert [e["node_id"] for e in excluded] == straggler["nodes"]
    assert summary["excluded_nodes"] == [{"node_id": e["node_id"], "reason": e["reason"]} for e in excluded]
    # Shrunk to 3 and never grown back onto the excluded node (grow checks every 0.5 s).
    assert [(e["old_dp"], e["new_dp"]) for e in events_of(run_dir, "resize")] == [(4, 3)]


@pytest.mark.parametrize("dp,rank", [(3, 1), (2, 0)])
def test_bitflip_detected_repaired_and_loss_exact(ray_cluster, reference_losses_cluster, tmp_path, dp, rank):
    """A low mantissa bit flipped in one weight at step 12 (no loss spike: silent). Checks every
    5 steps: found at step 15, every rank rolls back to step 10 and replays the same samples.
    At dp 3 the vote names the odd replica; at dp 2 nobody can, and both roll back. The
    later checks pass (every replica bitwise identical again) and every step's loss and grad
    norm equal those of the fault-free run without checks, exactly: at dp 2 the session's
    fault-free run of the same job (``reference_losses_cluster``: dp 2, 32 steps), at dp 3 a
    run made here."""
    address = ray_cluster.address
    steps = STEPS if dp == 2 else 22
    spec = _spec(steps, min_dp=dp, max_dp=dp, sdc_check_every=5)
    if dp == 2:
        want = reference_losses_cluster
    else:
        want = step_metrics(_api_run(tmp_path, "ref", _spec(steps, min_dp=dp, max_dp=dp)))  # checks off
    run_dir, summary = _cli_run(tmp_path, "flip", spec, address, f"bitflip@12:rank={rank}:bit=20")
    assert summary["status"] == "succeeded" and summary["steps"] == steps
    sdc = events_of(run_dir, "sdc")
    assert len(sdc) == 1, sdc
    assert sdc[0]["step"] == 15 and sdc[0]["restored_step"] == 10 and sdc[0]["action"] == "repair"
    if dp == 3:
        assert sdc[0]["ranks"] == [rank] and sdc[0]["replica"] == rank
    else:
        assert sdc[0]["ranks"] == [0, 1] and sdc[0]["replica"] is None
    assert [f["cause"] for f in events_of(run_dir, "failure")] == ["sdc"]
    assert events_of(run_dir, "failure")[0]["nodes"] if dp == 3 else True
    got = step_metrics(run_dir)
    assert sorted(got) == sorted(want) == list(range(1, steps + 1))
    assert got == want  # bitwise: the same state at step 10, the same samples after it
