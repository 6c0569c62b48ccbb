"""``model.kind: custom`` end to end through the CLI: the example in ``examples/`` (a user's own
transformer file plus its job spec) trains with ``elastic run``, and recovers from a real node
loss (``--fault kill_node``) on the fault-free losses."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest
from elastic_testlib import REL_SAME_ORDER, events_of, step_metrics

pytestmark = pytest.mark.cluster

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SPEC = os.path.join("examples", "custom-model.yaml")
STEPS = 12


def _elastic_run(run_dir: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """`elastic run` from the repository root, as the example's header says."""
    cmd = [sys.executable, "-m", "jobs.cli", "run", SPEC, "--run-dir", run_dir, *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400, env=env)


_RUNS: dict[str, str] = {}


@pytest.fixture
def fault_free(ray_local, tmp_path_factory):
    """The example run fault-free on the shared local Ray (once per session)."""
    if "run" not in _RUNS:
        run_dir = str(tmp_path_factory.mktemp("custom") / "run")
        proc = _elastic_run(run_dir, "--address", ray_local.get_runtime_context().gcs_address)
        assert proc.returncode == 0, proc.stderr[-3000:]
        _RUNS["run"] = run_dir
    return _RUNS["run"]


@pytest.mark.timeout(300)
def test_custom_model_trains_through_elastic_run(fault_free):
    summary = json.load(open(os.path.join(fault_free, "summary.json")))
    assert summary["status"] == "succeeded" and summary["steps"] == STEPS
    losses = [loss for loss, _ in step_metrics(fault_free).values()]
    assert losses[-1] < losses[0] - 0.3, losses  # it learns
    assert {e["dp"] for e in events_of(fault_free, "step")} == {2}


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_custom_model_recovers_from_node_loss(fault_free, tmp_path):
    """A worker node is SIGKILLed on the CLI's embedded multi-node cluster; the run shrinks to
    dp 1, restores from peer memory and finishes on the fault-free losses (1e-5, as
    tests/integration/test_node_loss.py: the same micro-batch gradients summed in another order)."""
    run_dir = str(tmp_path / "run")
    # A private temp dir: the CLI must start its own cluster, not find another one on this machine.
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    # Short: Ray's socket paths under it must stay below the 107-byte limit of Unix sockets.
    env["TMPDIR"] = tempfile.mkdtemp(prefix="cm", dir="/tmp")
    slow = [f"slow@1:rank={r}:seconds=0.2" for r in range(2)]  # so that the kill lands mid-run
    try:
        proc = _elastic_run(run_dir, "--fault", "kill_node@4", *[a for s in slow for a in ("--fault", s)], env=env)
    finally:
        shutil.rmtree(env["TMPDIR"], ignore_errors=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [f["cause"] for f in events_of(run_dir, "failure")] == ["node_lost"]
    assert [(e["old_dp"], e["new_dp"]) for e in events_of(run_dir, "resize")] == [(2, 1)]
    got, want = step_metrics(run_dir), step_metrics(fault_free)
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
    worst = max(abs(g - w) / abs(w) for s in want for g, w in zip(got[s], want[s]))
    print(f"max relative difference to the fault-free run: {worst:.2e} (tolerance {REL_SAME_ORDER:g})")
    assert worst <= REL_SAME_ORDER
