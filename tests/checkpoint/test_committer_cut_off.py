"""Storage checkpoints that a re-formation or the job's end cut off are never lost silently
(``elastic/checkpoint/committer.py``): a due step whose uploads were dropped is recorded as
not committed, with why, once it can no longer complete, and only then."""

from __future__ import annotations

import pytest
from elastic_testlib import elastic_spec

from elastic.checkpoint.committer import CheckpointCommitter
from elastic.events import EventLog, read_events
from elastic.messages import UploadReport

pytestmark = pytest.mark.timeout(60)

CUT = "its uploads were cut off by a re-formation (node_lost)"


def _committer(tmp_path, every: int = 5, steps: int = 40) -> CheckpointCommitter:
    spec = elastic_spec()
    spec.checkpoint.every_steps, spec.train.steps = every, steps
    return CheckpointCommitter(spec, str(tmp_path / "ckpt"), EventLog(str(tmp_path / "run")))


def _done(c: CheckpointCommitter, step: int, gen: tuple[int, int], ranks=None) -> None:
    """Ranks' reports of ``step`` under ``gen`` (a replay of a committed step: no files needed)."""
    for rank in range(gen[1]) if ranks is None else ranks:
        c.add(rank, UploadReport(step, rank, gen, {}, None, None, 0.1, 0.0, 0.0, 0, already_committed=True))


def _not_committed(tmp_path) -> list[tuple[int, str]]:
    events = read_events(str(tmp_path / "run"))
    return [(e["step"], e["error"]) for e in events if e["kind"] == "checkpoint" and e["committed"] is False]


def test_a_due_step_cut_off_is_recorded_once_it_can_no_longer_complete(tmp_path):
    c = _committer(tmp_path)
    _done(c, 5, (0, 2))
    _done(c, 10, (0, 2), ranks=[0])  # rank 1's part still on its way
    c.cut_off(0, 17, CUT)  # steps 10 and 15 of generation (0, 2) not settled
    assert c.failures == []  # a report already on its way may still complete them
    _done(c, 10, (0, 2), ranks=[1])  # it does, for step 10
    assert c.failures == []
    _done(c, 20, (17, 1))  # the next generation wrote past step 15: it can no longer complete
    assert c.join(10)
    assert c.failures == [{"step": 15, "cause": CUT}]
    assert _not_committed(tmp_path) == [(15, CUT)]
    assert c.settled(15)
    c.close()


def test_a_partial_step_superseded_names_the_ranks_that_had_uploaded_it(tmp_path):
    c = _committer(tmp_path)
    _done(c, 5, (0, 3), ranks=[0, 2])
    _done(c, 10, (0, 3), ranks=[1])
    c.cut_off(0, 10, CUT)
    _done(c, 10, (7, 2))  # step 10 trained again and uploaded by the next generation: committed
    assert c.join(10)
    assert c.failures == [{"step": 5, "cause": f"{CUT}; ranks [0, 2] of 3 had uploaded it"}]
    c.close()
    # A partial step that no cut-off explains (a rank's upload skipped): recorded too.
    c = _committer(tmp_path / "skip")
    _done(c, 5, (0, 2), ranks=[0])
    _done(c, 10, (0, 2))
    assert c.failures == [
        {"step": 5, "cause": "the other ranks' uploads were cut off or skipped; ranks [0] of 2 had uploaded it"}
    ]
    c.close()


def test_the_job_end_records_every_due_step_it_cut_off_and_nothing_settled(tmp_path):
    c = _committer(tmp_path, every=5, steps=12)
    end = "its uploads were cut off by the job's end"
    _done(c, 5, (0, 2))
    c.cut_off(0, 12, end)  # 10 and the last step 12 (due though not a multiple of 5)
    c.close()
    assert c.failures == [{"step": 10, "cause": end}, {"step": 12, "cause": end}]
    # Nothing due, or everything settled: nothing recorded.
    c = _committer(tmp_path / "settled", every=5, steps=12)
    _done(c, 5, (0, 1))
    c.cut_off(0, 9, end)
    c.cut_off(5, 5, end)
    c.close()
    assert c.failures == []


def test_a_step_dropped_on_purpose_is_recorded_at_once(tmp_path):
    c = _committer(tmp_path)
    why = "dropped: written after the last verified step 10 (an SDC check failed)"
    c.dropped(15, why)
    assert c.failures == [{"step": 15, "cause": why}]
    c.dropped(15, "again")  # recorded once
    assert len(c.failures) == 1
    c.close()
