"""Pure parts of the health checks (docs/health.md): no Ray, no process group."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from elastic.control.health import CommitGate, LemonTracker, StragglerDetector
from elastic.faults import flip_bit
from elastic.worker.sdc import fingerprint, word_sum_fingerprint
from elastic.worker.sdc_vote import sdc_due, twin_groups, vote

pytestmark = pytest.mark.timeout(30)


# ----- stragglers


def test_straggler_reported_after_consecutive_steps_and_once():
    det = StragglerDetector(factor=1.3, steps=5)
    found = [det.feed({0: 1.0, 1: 1.0, 2: 1.35, 3: 1.0}) for _ in range(8)]
    assert found[:4] == [None] * 4
    assert found[4] is not None and found[4].ranks == [2] and found[4].slowdown == pytest.approx(1.35)
    assert found[5:] == [None] * 3  # one report per episode


def test_straggler_streak_broken_by_one_normal_step():
    det = StragglerDetector(factor=1.3, steps=3)
    seq = [1.5, 1.5, 1.0, 1.5, 1.5, 1.5]
    out = [det.feed({0: 1.0, 1: s, 2: 1.0}) for s in seq]
    assert [o is not None for o in out] == [False, False, False, False, False, True]


def test_a_new_episode_is_reported_again():
    det = StragglerDetector(factor=1.3, steps=2)
    out = [det.feed({0: 1.0, 1: s}) for s in (2.0, 2.0, 1.0, 2.0, 2.0)]
    assert [o is not None and o.ranks == [1] for o in out] == [False, True, False, False, True]


def test_no_false_report_under_noise():
    """Every rank's compute jittered by up to +-25% (a loaded machine): 2000 steps, 4 ranks."""
    rng = random.Random(0)
    det = StragglerDetector(factor=1.3, steps=5)
    for _ in range(2000):
        assert det.feed({r: 0.1 * rng.uniform(0.75, 1.25) for r in range(4)}) is None


def test_peer_median_ignores_the_straggler_itself():
    # Two slow ranks of four: each is compared with the median of its three peers (1, 1, 2).
    ep = StragglerDetector(factor=1.3, steps=1).feed({0: 1.0, 1: 1.0, 2: 2.0, 3: 2.0})
    assert ep.ranks == [2, 3] and ep.slowdown == 2.0
    # One slow rank of two: the other rank is its reference, and it is not slow itself.
    ep = StragglerDetector(factor=1.3, steps=1).feed({0: 1.0, 1: 1.5})
    assert ep.ranks == [1]


def test_warm_up_steps_of_each_layout_are_not_judged():
    """A rank slow in its first ``warmup`` steps (a cold start on a shared host) is not
    counted; slowness after them is, and a reset (a new layout) starts a new warm-up."""
    det = StragglerDetector(factor=1.3, steps=2, warmup=3)
    slow = {0: 1.0, 1: 1.0, 2: 2.0}
    assert [det.feed(slow) for _ in range(4)] == [None] * 4  # 3 not judged, then 1 of 2
    assert det.feed(slow).ranks == [2]
    det.reset()
    assert [det.feed(slow) for _ in range(4)] == [None] * 4
    assert det.feed(slow).ranks == [2]


def test_monitor_restarts_the_warm_up_at_a_same_size_re_formation(tmp_path):
    """A lost node replaced keeps the world size; the controller announces the new layout
    (``new_layout``, from every re-formation), and its first steps are not judged."""
    from types import SimpleNamespace

    from elastic.control.health import STRAGGLER_WARMUP_STEPS, HealthMonitor
    from elastic.events import EventLog, read_events
    from jobs import JobSpec

    def stragglers() -> int:
        return sum(e["kind"] == "straggler" for e in read_events(str(tmp_path)))

    spec = JobSpec.from_dict({"elastic": {"straggler_steps": 1}, "train": {"steps": 100}})
    monitor = HealthMonitor(spec, EventLog(str(tmp_path)), lambda: [], lambda nodes: None, None)
    rows = SimpleNamespace(ranks=np.arange(3), compute_s=np.array([1.0, 1.0, 2.0]))
    for step in range(1, STRAGGLER_WARMUP_STEPS + 1):
        assert monitor.on_step(step, rows) is None
    assert monitor.on_step(STRAGGLER_WARMUP_STEPS + 1, rows) is None  # reported, not evicted
    assert stragglers() == 1
    monitor.new_layout()
    for step in range(1, STRAGGLER_WARMUP_STEPS + 1):
        monitor.on_step(step, rows)
    assert stragglers() == 1  # the new layout's warm-up
    monitor.on_step(STRAGGLER_WARMUP_STEPS + 1, rows)
    assert stragglers() == 2  # a new count: reported again


def test_single_rank_never_a_straggler():
    assert StragglerDetector(1.3, 1).feed({0: 5.0}) is None


# ----- SDC vote


def test_vote_majority_names_the_odd_rank():
    v = vote([7, 7, 9, 7], [[0, 1, 2, 3]])
    assert not v.ok and v.odd == (2,) and v.decided


def test_vote_two_replicas_cannot_decide():
    v = vote([7, 9], [[0, 1]])
    assert v.odd == (0, 1) and not v.decided


def test_vote_tie_cannot_decide():
    v = vote([1, 1, 2, 2], [[0, 1, 2, 3]])
    assert v.odd == (0, 1, 2, 3) and not v.decided


def test_vote_per_shard_groups():
    # tp=2, dp=3: ranks (0,1) (2,3) (4,5); twins are {0,2,4} and {1,3,5}; rank 3 is odd.
    groups = twin_groups([(0, 0), (0, 1)] * 3)
    assert groups == [[0, 2, 4], [1, 3, 5]]
    fps = [10, 20, 10, 21, 10, 20]
    v = vote(fps, groups)
    assert v.odd == (3,) and v.decided
    assert vote([10, 20, 10, 20, 10, 20], groups).ok


def test_sdc_due():
    assert [s for s in range(1, 26) if sdc_due(s, 10, 25)] == [10, 20, 25]
    assert not any(sdc_due(s, 0, 25) for s in range(1, 26))


# ----- fingerprint


def test_fingerprint_sees_any_single_bit_flip():
    torch.manual_seed(0)
    params = [torch.randn(64, 32), torch.randn(32)]
    base = fingerprint(params)
    assert fingerprint([p.clone() for p in params]) == base
    for bit in (0, 7, 22, 30, 31):
        for index in (0, 5, 31):
            copy = [p.clone() for p in params]
            flip_bit(copy[1], bit, index)
            assert fingerprint(copy) != base, (bit, index)


def test_accelerator_fingerprint_sees_any_single_bit_flip_even_in_a_view_that_starts_mid_word():
    """The arithmetic a GPU runs (``word_sum_fingerprint``), here on CPU tensors: a bf16 view
    two bytes into its storage, 32 bytes long, cannot be read as int64 words in place."""
    torch.manual_seed(0)
    backing = torch.randn(17).to(torch.bfloat16)
    params = [torch.randn(64, 32), torch.randn(1003).to(torch.bfloat16), backing[1:]]
    base = word_sum_fingerprint(params)
    assert word_sum_fingerprint([p.clone() for p in params]) == base
    for which in range(3):
        for bit in (0, 7, 15):
            copy = [p.clone() for p in params]
            flip_bit(copy[which], bit, 3)
            assert word_sum_fingerprint(copy) != base, (which, bit)


# ----- lemon nodes


def test_lemon_after_limit_and_job_wide_failures_blame_nobody():
    t = LemonTracker(2)
    nodes = ["a", "b", "c"]
    assert t.blame(["a", "b", "c"], nodes, "collective_timeout") == []
    assert t.blame(["a"], nodes, "actor_died") == []
    assert t.blame(["b"], nodes, "actor_died") == []
    assert t.blame(["a"], nodes, "straggler") == ["a"]
    assert t.blame(["a"], nodes, "straggler") == []  # excluded once
    assert "straggler" in t.excluded["a"]
    assert LemonTracker(0).blame(["a"], nodes, "x") == []


# ----- commit gate


class _Committer:
    def __init__(self):
        self.added, self.dropped_steps, self.closed = [], [], False

    def add(self, rank, report):
        self.added.append((report.step, rank))

    def dropped(self, step, cause):
        self.dropped_steps.append((step, cause))

    def close(self):
        self.closed = True

    def join(self, timeout=1.0):
        return True


class _Upload:
    def __init__(self, step):
        self.step = step


def test_commit_gate_commits_only_verified_steps():
    inner = _Committer()
    gate = CommitGate(inner)
    gate.add(0, _Upload(5))
    gate.add(1, _Upload(5))
    gate.add(0, _Upload(15))
    assert inner.added == []
    gate.verify(10)
    assert inner.added == [(5, 0), (5, 1)]
    gate.drop_after(10)  # a check at 20 failed: step 15 is never committed, and says why
    assert inner.dropped_steps == [(15, "dropped: written after the last verified step 10 (an SDC check failed)")]
    gate.verify(20)
    assert inner.added == [(5, 0), (5, 1)]
    gate.add(0, _Upload(8))  # at or before a verified step: straight through
    assert inner.added[-1] == (8, 0) and gate.join() is True
    gate.add(0, _Upload(25))  # never verified before the job's end: recorded as not committed
    gate.close()
    assert inner.dropped_steps[-1] == (25, "no SDC check verified it before the job ended") and inner.closed


# ----- own compute


def test_own_backward_marks_the_end_of_the_local_backward():
    """The callback queued from the loss's hook runs when this rank's backward is done, before
    any later callback (DDP's wait for the gradient sync is one): what follows it is a wait.
    ``torch.autograd.Variable._execution_engine.queue_callback`` is private torch API."""
    from torch.autograd import Variable

    from elastic.engine import _own_backward

    order = []
    w = torch.randn(8, 8, requires_grad=True)
    loss = (w @ w).sum()

    def later(grad):  # queued after ours (like DDP's, from a gradient hook), blocks 50 ms
        Variable._execution_engine.queue_callback(lambda: (order.append("later"), __import__("time").sleep(0.05)))

    w.register_hook(later)
    with _own_backward(loss) as own:
        loss.backward()
    assert own.local_done is not None
    assert 0.04 <= own.waited_s < 1.0, own.waited_s
    assert order == ["later"]


def test_lemon_tracker_spares_a_one_node_job_and_software_errors():
    """The only node of a job is never excluded (it would end the job), and a rank's own
    exception says nothing about the hardware."""
    only = LemonTracker(limit=2)
    assert only.blame(["n0"], ["n0"], "actor_died") == [] and only.blame(["n0"], ["n0"], "actor_died") == []
    assert only.excluded == {}
    soft = LemonTracker(limit=2)
    for _ in range(3):
        assert soft.blame(["n1"], ["n0", "n1"], "worker_error") == []
    assert soft.blame(["n1"], ["n0", "n1"], "actor_died") == []
    assert soft.blame(["n1"], ["n0", "n1"], "node_lost") == ["n1"]


def test_a_worker_error_that_its_node_caused_counts_against_the_node():
    """A rank's call that failed for its node's sake (a full disk: ``NodeResourceError``) is a
    ``worker_error`` whose event says ``node_fault``: it counts, so the node is excluded
    instead of every retry in place meeting the same disk until the budget runs out."""
    from elastic.errors import NodeResourceError, WorkerError, failure_fields

    full = NodeResourceError("configure failed: OutOfDiskError", ranks=[1], nodes=["n1"])
    fields = failure_fields(full)
    assert fields["cause"] == "worker_error" and fields["node_fault"] is True
    assert "node_fault" not in failure_fields(WorkerError("configure failed: ValueError", ranks=[1], nodes=["n1"]))
    t = LemonTracker(limit=2)
    assert t.blame(["n1"], ["n0", "n1"], fields["cause"], fields["node_fault"]) == []
    assert t.blame(["n1"], ["n0", "n1"], fields["cause"], fields["node_fault"]) == ["n1"]


def test_a_few_milliseconds_over_is_noise_not_a_straggler():
    """On a 7 ms step 36% over is 2.5 ms: under the 5 ms floor, no report; 10 ms over is one."""
    det = StragglerDetector(factor=1.3, steps=1)
    assert det.feed({0: 0.007, 1: 0.007, 2: 0.0095, 3: 0.007}) is None
    ep = det.feed({0: 0.007, 1: 0.007, 2: 0.017, 3: 0.007})
    assert ep is not None and ep.ranks == [2]
