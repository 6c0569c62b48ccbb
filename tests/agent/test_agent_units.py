"""The node agent's logic without Ray: scripted ranks, a test clock (``agent_testlib``).

Every rank call is a future the test answers (or lets die), so each rule of the agent is
checked on its own: a step's rows go up once per node, news of an outcome, a death or a
silence, commands answered per node (a failure first), a flush after the poll in flight,
items kept until acked, the step's abort passed to every rank still watched.
"""

from __future__ import annotations

import pytest
from agent_testlib import node, report

from elastic.agent.liveness import Outstanding
from elastic.agent.node import LINGER_S, POLL_WAIT_S, REPORT_SILENCE_S
from elastic.messages import (
    AbortStep,
    CommandDone,
    ConfigureReply,
    Detach,
    Flush,
    Launch,
    NodeConfigure,
    Poll,
    PollReply,
    Reconfigure,
    RunOutcome,
    Signal,
    UploadReport,
)

pytestmark = pytest.mark.timeout(30)


def _news(digest) -> tuple:
    """The node's news in a digest (a state without news clears it; no state: unchanged)."""
    state = digest.states.get("n0")
    return () if state is None else state.news


def _answer_polls(core, backend, replies: dict[int, PollReply]) -> None:
    for wid, reply in replies.items():
        backend.pending(f"r{wid}", Poll)[0].answer(reply)
    core.pump(0)


def test_a_step_goes_up_once_per_node_when_every_rank_reported():
    core, backend, clock = node(2)
    assert [f.args for f in backend.calls] == [(POLL_WAIT_S, -1, -1)] * 2  # one long poll per rank
    _answer_polls(core, backend, {0: PollReply(0, 1, "train", 0.0, [report(1)])})
    assert core.digest(None, 0.0).rows == []  # rank 1 has not reported step 1 yet
    _answer_polls(core, backend, {1: PollReply(1, 1, "train", 0.0, [report(1, 2.0)])})
    d = core.digest(None, 0.0)
    assert [(r.step, r.ranks.tolist(), r.compute_s.tolist()) for r in d.rows] == [(1, [0, 1], [1.0, 2.0])]
    assert len(backend.pending("r0", Poll)) == 1  # asked again at once


def test_rows_of_a_lagging_rank_go_up_after_the_linger():
    core, backend, clock = node(2)
    _answer_polls(core, backend, {0: PollReply(0, 1, "train", 0.0, [report(1)])})
    clock.t += LINGER_S * 1.5
    core.pump(0)
    assert [r.ranks.tolist() for r in core.digest(None, 0.0).rows] == [[0]]


def test_items_are_kept_until_acked_and_sent_again_to_a_new_parent():
    core, backend, clock = node(1)
    _answer_polls(core, backend, {0: PollReply(0, 1, "train", 0.0, [report(1)])})
    first = core.digest(None, 0.0)
    assert len(first.rows) == 1 and first.seqs == {"n0": 1}
    assert core.digest(None, 0.0).rows == []  # already sent to this parent
    assert len(core.digest(None, 0.0, resend=True).rows) == 1  # a new parent: everything not acked
    core.digest({"n0": 1}, 0.0)
    assert core.digest(None, 0.0, resend=True).rows == []  # acked: gone


def test_an_outcome_is_news_and_brings_the_ranks_rows_with_it():
    core, backend, clock = node(2)
    core.command(2, Launch(3))
    core.pump(0)
    out = RunOutcome("error", 1, "peer", "Connection closed")
    _answer_polls(core, backend, {0: PollReply(0, 1, "idle", 0.0, [report(1)], out, runs=1)})
    d = core.digest(None, 0.0)
    assert [r.ranks.tolist() for r in d.rows] == [[0]]  # not held back for rank 1
    (news,) = d.states["n0"].news
    assert news.wid == 0 and news.outcome == out and news.since == 2


def test_an_outcome_of_an_earlier_run_is_stale():
    core, backend, clock = node(1)
    stopped = RunOutcome("stopped", 4)
    _answer_polls(core, backend, {0: PollReply(0, 4, "idle", 0.0, [], stopped, runs=1)})
    assert core.digest(None, 0.0).states["n0"].news[0].outcome == stopped
    core.command(3, Launch(9))  # a new run: the rank still shows the old outcome until it starts
    core.pump(0)
    _answer_polls(core, backend, {0: PollReply(0, 4, "idle", 0.0, [], stopped, runs=1)})
    assert _news(core.digest(None, 0.0)) == ()
    _answer_polls(core, backend, {0: PollReply(0, 5, "idle", 0.0, [], RunOutcome("done", 9), runs=2)})
    assert core.digest(None, 0.0).states["n0"].news[0].outcome.status == "done"


def test_a_dead_rank_is_news_at_once():
    core, backend, clock = node(2)
    backend.pending("r1", Poll)[0].answer(status="dead")
    core.pump(0)
    (news,) = core.digest(None, 0.0).states["n0"].news
    assert news.wid == 1 and news.dead
    assert backend.pending("r1", Poll) == []  # not asked again


def test_a_detached_rank_is_not_polled_and_its_process_is_ended():
    """A killed rank may be stopped or hung in its step: its agent ends the process at once."""
    core, backend, clock = node(2)
    core.command(2, Detach((1,), pids=(4242,)))
    core.pump(0)
    assert backend.ended == [4242]
    assert set(core.ranks) == {0} and 1 not in core.polls


def test_ending_a_process_spares_one_that_is_no_rank():
    """The pid of a dead rank may be reused: only a Ray worker process is ended."""
    import subprocess
    import sys

    from elastic.agent.ranks import ActorRanks

    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        ActorRanks(bell=None).end(other.pid)
        ActorRanks(bell=None).end(0)
        assert other.poll() is None  # still running
    finally:
        other.kill()
        other.wait(timeout=10)


def test_a_silent_rank_is_news_past_due_and_not_before():
    core, backend, clock = node(1)
    clock.t += POLL_WAIT_S + REPORT_SILENCE_S * 0.5
    core.pump(0)
    assert _news(core.digest(None, 0.0)) == ()  # a long poll is not silence
    clock.t += REPORT_SILENCE_S
    core.pump(0)
    (news,) = core.digest(None, 0.0).states["n0"].news
    assert news.silent_s == pytest.approx(REPORT_SILENCE_S * 1.5)
    backend.pending("r0", Poll)[0].answer(status="unavailable")  # a retry keeps the first due time
    clock.t += REPORT_SILENCE_S
    core.pump(0)
    assert core.digest(None, 0.0).states["n0"].news[0].silent_s == pytest.approx(REPORT_SILENCE_S * 2.5)
    _answer_polls(core, backend, {0: PollReply(0, 0, "idle", 0.0)})
    cleared = core.digest(None, 0.0)
    assert "n0" in cleared.states and _news(cleared) == ()  # said once: no news any more
    assert core.digest(None, 0.0).states == {}  # and not again


def test_configure_is_answered_per_node_and_a_failure_first():
    core, backend, clock = node(3)
    core.command(5, NodeConfigure({0: "req0", 1: "req1", 2: "req2"}))
    core.pump(0)
    calls = {f.handle: f for f in backend.calls if isinstance(f.call, Reconfigure)}
    assert set(calls) == {"r0", "r1", "r2"} and calls["r1"].args == ("req1",)
    calls["r1"].answer("ValueError: bad", status="error")
    core.pump(0)
    (early,) = [i for _, _, i in core.digest(None, 0.0).items]
    assert early == CommandDone(5, {}, {1: "ValueError: bad"}, (), early.state)  # before the others answer
    calls["r0"].answer(ConfigureReply(0, 7, 0.1, 0.1, 0.1))
    calls["r2"].answer(status="dead")
    core.pump(0)
    (done,) = [i for _, _, i in core.digest(None, 0.0).items]
    assert done.cid == 5 and set(done.replies) == {0} and done.lost == (2,) and done.errors == {}


def test_a_call_failed_by_its_node_is_named_so():
    """A call that failed for the node's sake (Ray's full disk: ``ranks.node_fault``) goes up
    with the errors and is named in ``node_faults``; a rank's own error is not."""
    from ray.exceptions import OutOfDiskError, RayTaskError

    from elastic.agent.ranks import node_fault

    core, backend, clock = node(2)
    core.command(5, NodeConfigure({0: "req0", 1: "req1"}))
    core.pump(0)
    calls = {f.handle: f for f in backend.calls if isinstance(f.call, Reconfigure)}
    calls["r0"].answer("OutOfDiskError: disk full", status="node_fault")
    calls["r1"].answer("ValueError: bad", status="error")
    core.pump(0)
    (done,) = [i for _, _, i in core.digest(None, 0.0).items]
    assert done.errors == {0: "OutOfDiskError: disk full", 1: "ValueError: bad"} and done.node_faults == (0,)
    disk = OutOfDiskError("the object store's disk is full")
    assert node_fault(disk) and not node_fault(ValueError("bad"))
    wrapped = RayTaskError("configure", "traceback", disk)  # raised inside the rank
    assert node_fault(wrapped) and not node_fault(RayTaskError("configure", "traceback", ValueError("bad")))


def test_a_flush_answers_after_the_poll_in_flight_and_its_reports():
    core, backend, clock = node(1)
    long_poll = backend.pending("r0", Poll)[0]
    core.command(6, Flush())
    core.pump(0)
    (short,) = [f for f in backend.pending("r0", Poll) if f.args[0] == 0.0]
    short.answer(PollReply(0, 2, "train", 0.0, [report(2)]))
    core.pump(0)
    early = core.digest(None, 0.0)
    assert [r.step for r in early.rows] == [2] and early.items == []  # the long poll may carry reports too
    long_poll.answer(PollReply(0, 1, "train", 0.0, [report(1)]))
    core.pump(0)
    d = core.digest(None, 0.0)
    assert [r.step for r in d.rows] == [1] and [i.cid for _, _, i in d.items] == [6]
    seqs = [s for s, _ in core.items]
    assert d.items[0][1] == max(seqs)  # the answer comes after every report it flushed


def test_liveness_judges_requests_past_due_not_the_time_since_the_last_reply():
    """A driver stalled for 2x the timeout: the answers that came meanwhile are taken in
    first, and the new requests are not yet due, so nobody is silent."""
    o = Outstanding()
    o.issued("a", now=0.0, answer_within_s=1.0)
    o.issued("b", now=0.0, answer_within_s=1.0)
    # ... the stall: 20 s pass; both answered meanwhile, taken in before judging
    o.answered("a")
    o.answered("b")
    o.issued("a", now=20.0, answer_within_s=1.0)
    o.issued("b", now=20.0, answer_within_s=1.0)
    assert o.silent(now=20.0, threshold_s=10.0) == {}
    # a peer that did not answer is silent once its request is past due by the timeout
    assert o.silent(now=31.5, threshold_s=10.0) == {"a": 10.5, "b": 10.5}


def test_an_unreachable_peer_is_silent_from_the_failed_call_not_the_end_of_its_long_poll():
    """A node killed whole: the call to its agent fails at once (connection refused). Its
    silence counts from then, so the driver probes its raylet after the grace, not a long
    poll (1 s) later; a later failure does not push the moment back."""
    o = Outstanding()
    o.issued("a", now=0.0, answer_within_s=1.0)
    o.unreachable("a", now=0.1)
    assert o.silent(now=0.6, threshold_s=0.0) == {"a": pytest.approx(0.5)}
    o.unreachable("a", now=0.5)  # asked again, refused again
    assert o.overdue_s("a", now=0.6) == pytest.approx(0.5)


def test_abort_step_reaches_every_rank_of_the_node_that_is_still_one():
    """The driver's abort of the step in flight is one Signal per node (not a call per rank
    from the driver); the agent passes it, with the generation it abandons (a rank ignores
    a late one for a generation it has left), to each rank it still watches."""
    core, backend, _ = node(ranks=3)
    core.command(2, Detach((2,), ()))
    core.command(3, Signal(AbortStep(7)))
    aborts = [f for f in backend.calls if isinstance(f.call, AbortStep)]
    assert sorted(f.handle for f in aborts) == ["r0", "r1"] and {f.call for f in aborts} == {AbortStep(7)}
    links = frozenset({("10.0.0.1", 5000, "10.0.0.2", 6000)})  # to the lost ranks, as the survivors see them
    core.command(4, Signal(AbortStep(8, links)))
    assert {f.call for f in backend.calls if isinstance(f.call, AbortStep)} == {AbortStep(7), AbortStep(8, links)}


def test_reports_are_acked_back_to_the_worker_once_the_driver_has_them():
    """Numbered reports: the agent passes on what it has (``have``) and, once the driver
    acked the item that carried a report, that the worker may drop it (``ack``)."""
    core, backend, clock = node(1)
    upload = UploadReport(1, 0, (0, 1), {}, None, None, 0.0, 0.0, 0.0, 0)
    _answer_polls(core, backend, {0: PollReply(0, 1, "train", 0.0, [report(1), upload], first_seq=7)})
    d = core.digest(None, 0.0)
    assert [(i.wid, i.seq) for _, _, i in d.items] == [(0, 8)]
    assert backend.pending("r0", Poll)[0].args == (POLL_WAIT_S, -1, 8)  # has 7 and 8, nothing acked
    core.digest(d.seqs, 0.0)  # the driver has both items
    backend.pending("r0", Poll)[0].answer(PollReply(0, 1, "train", 0.0))
    core.pump(0)
    assert backend.pending("r0", Poll)[0].args == (POLL_WAIT_S, 8, 8)
    # A report sent again (not acked when the worker answered) is taken in once.
    _answer_polls(core, backend, {0: PollReply(0, 1, "train", 0.0, [upload], first_seq=8)})
    assert core.digest(None, 0.0).items == []


def test_a_new_agent_gets_every_report_not_acked_from_the_worker():
    """The worker's queue keeps reports until acked: an agent replacing a lost one (asking
    with nothing) gets them again; acked ones are gone."""
    from elastic.worker.outbox import ReportQueue

    q = ReportQueue()
    for i in range(5):
        q.append(f"r{i + 1}")
    assert q.take(ack=None, have=-1, keep=True) == (1, ["r1", "r2", "r3", "r4", "r5"])
    assert q.take(ack=2, have=5, keep=True) == (0, [])  # the first agent had 1-5, the driver 1-2
    assert q.take(ack=None, have=-1, keep=True) == (3, ["r3", "r4", "r5"])  # a new agent
    assert q.has_after(4) and not q.has_after(5)
    assert q.take(ack=None, have=-1, keep=False) == (3, ["r3", "r4", "r5"]) and not q.has_after(-1)


def test_every_rank_call_names_a_rank_method_with_its_fields_as_parameters():
    """A typed call reaches ``TrainWorker.<method>`` with its fields in order
    (``rank_call_args``): the names must agree with the rank's, and the forwarder's."""
    import inspect
    import typing

    from elastic.messages import RankCall
    from elastic.worker.actor import Rank
    from elastic.worker.remote import TrainWorker

    for kind in typing.get_args(RankCall):
        params = [p for p in inspect.signature(getattr(Rank, kind.method)).parameters if p != "self"]
        assert kind.__match_args__ == tuple(params), kind
        assert hasattr(TrainWorker, kind.method), kind
