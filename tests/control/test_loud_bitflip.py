"""A bit flip that shows up as a NaN loss, from the CLI with SDC checks on (docs/health.md).

Bit 30 (the top exponent bit) of one weight of rank 1 flips before step 12: the loss every
rank agrees on is not finite. The replicas' fingerprints disagree, so the cause is the
hardware, not the batch: every rank rolls back to the verified step 10 and trains the same
batches again (an ``sdc`` event; no batch skipped), ending on the fault-free curve. A NaN that
every replica shares (both ranks' weights set to NaN) is the data's fault: its batch is
skipped, as without SDC checks.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml
from elastic_testlib import STEPS, assert_matches_reference, elastic_spec, events_of, step_metrics

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]


def _run(tmp_path, name, address, *faults):
    spec = elastic_spec(min_dp=2, max_dp=2, heartbeat_timeout_s=30, collective_timeout_s=60, sdc_check_every=5)
    spec.elastic.on_bad_loss = "skip"
    config = tmp_path / f"{name}.yaml"
    config.write_text(yaml.safe_dump(spec.model_dump(mode="json", by_alias=True)))
    run_dir = str(tmp_path / name)
    cmd = [sys.executable, "-m", "jobs.cli", "run", str(config), "--run-dir", run_dir, "--address", address]
    for f in faults:
        cmd += ["--fault", f]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir, json.load(open(f"{run_dir}/summary.json"))


def test_loud_bitflip_is_repaired_and_a_shared_nan_skipped(ray_local, reference_losses, tmp_path):
    """``reference_losses``: the same spec at dp 2 without faults or checks (tests/conftest.py)."""
    address = ray_local.get_runtime_context().gcs_address

    run_dir, summary = _run(tmp_path, "flip", address, "bitflip@12:rank=1:bit=30")
    assert summary["status"] == "succeeded" and summary["steps"] == STEPS
    (sdc,) = events_of(run_dir, "sdc")
    assert sdc["step"] == 12 and sdc["restored_step"] == 10 and sdc["action"] == "repair", sdc
    assert sdc["ranks"] == [0, 1] and sdc["replica"] is None  # two replicas: nobody can tell which is wrong
    assert [f["cause"] for f in events_of(run_dir, "failure")] == ["sdc"]  # not nan_loss: no batch skipped
    assert [r["cause"] for r in summary["recoveries"]] == ["sdc"]
    assert_matches_reference(step_metrics(run_dir), reference_losses)

    shared, summary = _run(tmp_path, "nan", address, "nan@12:rank=0", "nan@12:rank=1")
    assert summary["status"] == "succeeded" and summary["steps"] == STEPS
    assert events_of(shared, "sdc") == []
    (failure,) = events_of(shared, "failure")
    assert failure["cause"] == "nan_loss" and "skip batch 11" in failure["detail"], failure
    got, want = step_metrics(shared), reference_losses
    assert got[11] == want[11] and got[12] != want[12]  # batch 11 (step 12's) skipped: a new curve from there
