"""No false evictions on a loaded machine: detection acts on signals, not on slowness.

Two busy processes (one per core of this 2-core machine) oversubscribe the CPU at least 2x
beside the four training workers. A fault-free run of 40 steps (about a minute under
this load, some 15 heartbeat timeouts of 4 s) must finish without a single ``failure`` or
``resize`` event: a slow poll answer, a slow raylet or a slow collective is not a death.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from elastic_testlib import elastic_spec, events_of

from elastic import ElasticTrainer

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(600)]

STEPS = 40


@pytest.fixture
def busy_cores():
    """One spinning process per core, killed with a real signal at the end."""
    procs = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
        for _ in range(os.cpu_count() or 2)
    ]
    yield procs
    for p in procs:
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=10)


def test_a_fault_free_run_on_an_oversubscribed_machine_has_no_failure(ray_local, busy_cores, tmp_path):
    assert all(p.poll() is None for p in busy_cores)
    # No failure is expected, so the first one ends the run (and says what it was) instead
    # of being retried until the test's own timeout.
    spec = elastic_spec(min_dp=4, max_dp=4, max_failures=0)
    spec.train.steps = STEPS
    trainer = ElasticTrainer(spec, run_dir=str(tmp_path / "run"))
    result = trainer.fit()
    assert all(p.poll() is None for p in busy_cores), "the load must last the whole run"
    assert events_of(trainer.run_dir, "failure") == []
    assert result.status == "succeeded" and result.steps == STEPS
    assert events_of(trainer.run_dir, "resize") == []
    assert result.failures == 0 and result.dp_history == [[0, 4]]
