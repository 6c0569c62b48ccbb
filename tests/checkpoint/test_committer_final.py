"""A failed or skipped final storage checkpoint always reaches ``summary.json``'s
``checkpoint_failures`` and a ``checkpoint`` event (``elastic/checkpoint/committer.py``):
its step committed before by someone else (another run on the same ``checkpoint.uri``: the
first commit is kept, and it is not this run's final state), or never complete. A replay of a
step this job committed itself (after a restore) is not a failure."""

from __future__ import annotations

import pytest
import torch
from elastic_testlib import elastic_spec

from elastic.checkpoint.committer import CheckpointCommitter
from elastic.checkpoint.storage_tier import open_store
from elastic.events import EventLog, read_events
from elastic.messages import UploadReport
from storage import write_rank_shard

pytestmark = pytest.mark.timeout(60)

STEPS = 4


def _committer(tmp_path, name: str) -> CheckpointCommitter:
    spec = elastic_spec()
    spec.checkpoint.every_steps, spec.train.steps = 2, STEPS
    return CheckpointCommitter(spec, str(tmp_path / "ckpt"), EventLog(str(tmp_path / name)))


def _upload(c: CheckpointCommitter, step: int, value: float) -> None:
    """One rank's real part of ``step`` (as the storage tier writes it), reported to ``c``;
    ``already_committed`` as a rank reports it when it found the step's marker."""
    store = open_store(c.uri, {})
    replay = store.read_marker(step) is not None
    res = None if replay else write_rank_shard(store, step, {"w": torch.full((4,), value)}, 0)
    c.add(0, UploadReport(step, 0, (0, 1), {"dp": 1}, res and res.to_dict(), None, 0.0, 0.1, 0.0, 0, replay))
    assert c.join(30)


def _storage_events(tmp_path, name: str) -> list[tuple[int, bool]]:
    return [(e["step"], e["committed"]) for e in read_events(str(tmp_path / name)) if e.get("tier") == "storage"]


def test_a_final_step_another_run_committed_is_a_failure_of_this_run(tmp_path):
    first = _committer(tmp_path, "run1")
    _upload(first, STEPS, 1.0)
    assert first.final_failure(STEPS) is None and first.failures == []
    first.close()
    second = _committer(tmp_path, "run2")  # another run, the same checkpoint.uri
    _upload(second, 2, 2.0)  # not the final step: a step kept as first committed, as before
    _upload(second, STEPS, 2.0)
    why = second.final_failure(STEPS)
    assert why is not None and f"step {STEPS} is already committed in storage, not by this job" in why
    assert second.failures == [{"step": STEPS, "cause": why}]
    assert _storage_events(tmp_path, "run2") == [(2, True), (STEPS, False)]
    second.close()


def test_a_replay_of_a_final_step_this_job_committed_is_no_failure(tmp_path):
    c = _committer(tmp_path, "run")
    _upload(c, STEPS, 1.0)
    _upload(c, STEPS, 1.0)  # trained again after a restore: the rank finds the marker
    assert c.final_failure(STEPS) is None and c.failures == []
    assert _storage_events(tmp_path, "run") == [(STEPS, True)]
    c.close()


def test_a_final_step_that_never_completed_is_recorded_when_the_job_ends(tmp_path):
    c = _committer(tmp_path, "run")
    why = c.final_failure(STEPS)  # no rank's upload of it arrived, nothing cut it off
    assert why == "not every rank's upload of it arrived"
    assert c.failures == [{"step": STEPS, "cause": why}] and _storage_events(tmp_path, "run") == [(STEPS, False)]
    assert c.final_failure(STEPS) == why and len(c.failures) == 1  # recorded once
    c.close()
