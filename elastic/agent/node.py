"""One node's agent: its ranks' polls and news, and the driver's commands to them.

Where it runs: in the ``NodeAgent`` actor on its node (``actors.py``), whose own thread
calls ``pump`` in a loop; for the control-plane benchmark, also hosted in an aggregator's
process with virtual ranks (``elastic/testing/virtual_nodes.py``). It reaches ranks through
a ``RankBackend`` (``ranks.py``: Ray actor calls) and answers its parent with ``Digest``s. It owns, for its node:

* liveness: one long poll in flight per rank; a rank whose poll is past due by more than
  ``REPORT_SILENCE_S`` is news (``liveness.py``), a poll that fails because the actor died
  is news at once, and so is a ``run()`` that ended (the poll's ``outcome``);
* reports: step reports become one ``StepRows`` block per step (once every rank of the node
  reported it, or after ``LINGER_S``), other reports go up as they are;
* commands (``NodeCommand``s, typed, each turned into typed calls to its ranks:
  ``RankCall``s): reconfigure, launch, stop, abandon, queries (snapshot holdings,
  checkpoints) and a flush of every report so far, each answered by one ``CommandDone`` per
  node (partial answers first when a rank fails, so the driver can abandon a generation at
  once).

Everything it sends up is numbered (``seq``) and kept until the driver acks it, so a
replacement parent asks again (``resend``) and loses nothing.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Protocol

from elastic.agent.gather import CallGather
from elastic.agent.liveness import Outstanding
from elastic.agent.rows import rows_of
from elastic.messages import (
    Attach,
    CommandDone,
    Detach,
    Digest,
    Flush,
    Launch,
    NodeCommand,
    NodeConfigure,
    NodeState,
    Poll,
    PollReply,
    Query,
    RankCall,
    RankNews,
    RankReport,
    Reconfigure,
    Run,
    RunOutcome,
    Signal,
    StepReport,
    StepRows,
)

POLL_WAIT_S = 1.0  # a rank's long poll: back at once with news, else after this
LINGER_S = 0.02  # a step's rows wait this long for the node's other ranks before going up
REPORT_SILENCE_S = 0.25  # a rank's poll this far past due is news, renewed as it grows by as much


class RankBackend(Protocol):
    """How the agent reaches its ranks: calls that return futures, and one wait for many."""

    def call(self, handle: Any, call: RankCall) -> Any: ...

    def wait(self, futures: list[Any], timeout_s: float) -> list[Any]: ...

    # ("ok", v) | ("dead" | "unavailable" | "error" | "node_fault", detail)
    def result(self, future: Any) -> tuple[str, Any]: ...

    def wake(self) -> None: ...

    def end(self, pid: int) -> None: ...  # SIGKILL a rank's process on this node


@dataclass
class _Rank:
    wid: int
    handle: Any
    rank: int
    step: int = 0
    dead_at: float | None = None
    outcome: RunOutcome | None = None
    outcome_at: float = 0.0
    runs_seen: int = 0  # the newest run count a poll answer carried
    stale_upto: int = -1  # outcomes of runs up to this one belong to an earlier layout or run
    silence_mark: int = 0  # how many REPORT_SILENCE_S its poll is past due, as last reported
    have: int = -1  # the worker's number of the last report this agent took in
    ack: int = -1  # ... and of the last one the driver has: the worker may drop it
    since: int = 0  # the command (reconfigure or launch) its current run belongs to


class AgentGone(RuntimeError):
    """A node's agent is gone with its node (raised by a local, virtual node's agent)."""


class NodeCore:
    def __init__(self, node: str, backend: RankBackend, clock=time.monotonic, poll_wait_s: float = POLL_WAIT_S):
        self.node, self.backend, self.clock, self.poll_wait_s = node, backend, clock, poll_wait_s
        self.ranks: dict[int, _Rank] = {}
        self.inflight: dict[Any, tuple] = {}  # future -> ("poll", wid) | ("call", cid, wid)
        self.polls: dict[int, Any] = {}  # wid -> its long poll in flight
        self.outstanding: Outstanding[int] = Outstanding()  # by worker id
        self.gathers: dict[int, CallGather] = {}
        self.items: list[tuple[int, Any]] = []  # (seq, StepRows | RankReport | CommandDone), until acked
        self.seq = self.sent = self.acked = 0
        self.version = self.sent_version = 0  # of the node's news
        # step -> (reports, first seen, wid -> the worker's number of its report)
        self.rows: dict[int, tuple[list[tuple[int, StepReport]], float, dict[int, int]]] = {}
        self.marks: dict[int, dict[int, int]] = {}  # item seq -> wid -> the worker's report number in it
        self.cond = threading.Condition()
        self.gone = False  # set when the node is lost (the benchmark's virtual nodes): every call raises
        self.on_news: Any = None  # a local parent's bell, rung when a pump made news (hosted nodes)
        self._rows_now = False

    # ------------------------------------------------------------------ the loop
    def pump(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for answers (or a command), then take in all that came."""
        with self.cond:
            futures = list(self.inflight)
            now = self.clock()
            wake = self._next_wake()
            if wake is not None:
                timeout_s = max(0.0, min(timeout_s, wake - now))
        ready = self.backend.wait(futures, timeout_s)
        with self.cond:
            now = self.clock()
            for f in ready:
                self._take(f, now)
            self._issue_polls(now)
            self._judge(now)
            self._emit_rows(now, force=self._rows_now)
            self._rows_now = False
            self._finish(now)
            self.cond.notify_all()
            news = self.has_news()
        if news and self.on_news is not None:
            self.on_news()

    def has_news(self) -> bool:  # whether a digest now would carry something
        return self.seq > self.sent or self.version != self.sent_version

    def _next_wake(self) -> float | None:
        times = [first + LINGER_S for _, first, _ in self.rows.values()]
        due = self.outstanding.next_deadline(REPORT_SILENCE_S)
        if due is not None:
            times.append(due)
        return min(times) if times else None

    def _take(self, future: Any, now: float) -> None:
        what = self.inflight.pop(future)
        status, value = self.backend.result(future)
        if what[0] == "poll":
            wid = what[1]
            if self.polls.get(wid) is future:
                del self.polls[wid]
            r = self.ranks.get(wid)
            if r is None:
                return
            if status == "ok":
                self.outstanding.answered(wid)
                self._on_poll(r, value, now)
            elif status == "dead":
                self._died(r, now)
            return  # unavailable: asked again, the silence keeps counting from the first ask
        _, cid, wid = what
        g = self.gathers.get(cid)
        if g is None or wid not in g.waiting:
            return
        if status == "ok" and what[0] == "call":
            g.replies[wid] = value
        elif status == "ok":  # a flush's short poll
            r = self.ranks.get(wid)
            if r is not None:
                self._on_poll(r, value, now)
            g.replies[wid] = True
        elif status == "dead":
            g.lost.append(wid)
            g.unsent += 1
            if wid in self.ranks:
                self._died(self.ranks[wid], now)
        else:  # "error", or "node_fault": the call failed for the node's sake (its disk is full)
            g.errors[wid] = value
            if status == "node_fault":
                g.node_faults.add(wid)
            g.unsent += 1
        g.waiting.discard(wid)

    def _on_poll(self, r: _Rank, reply: PollReply, now: float) -> None:
        r.rank = reply.rank if reply.rank >= 0 else r.rank
        r.step = reply.step
        r.runs_seen = max(r.runs_seen, reply.runs)
        for i, rep in enumerate(reply.reports):
            seq = reply.first_seq + i if reply.first_seq else 0  # 0: a worker that does not number them
            if seq and seq <= r.have:
                continue  # taken in before (a report is sent again until acked)
            r.have = max(r.have, seq)
            if isinstance(rep, StepReport):
                reports, _, marks = self.rows.setdefault(rep.step, ([], now, {}))
                reports.append((reply.rank, rep))
                marks[r.wid] = seq
            else:
                self._push(RankReport(reply.rank, rep, r.wid, seq), {r.wid: seq})
        if reply.outcome is not None and reply.runs > r.stale_upto and r.outcome is None:
            r.outcome, r.outcome_at = reply.outcome, now
            self.version += 1
            self._rows_now = True  # the steps it finished go up with its outcome, not after

    def _died(self, r: _Rank, now: float) -> None:
        if r.dead_at is None:
            r.dead_at = now
            self.version += 1
            self._rows_now = True
        self.outstanding.forget(r.wid)

    def _issue_polls(self, now: float) -> None:
        for wid, r in self.ranks.items():
            if r.dead_at is None and wid not in self.polls:
                f = self.backend.call(r.handle, Poll(self.poll_wait_s, r.ack, r.have))
                self.inflight[f] = ("poll", wid)
                self.polls[wid] = f
                if not self.outstanding.in_flight(wid):  # a retried poll keeps its first due time
                    self.outstanding.issued(wid, now, self.poll_wait_s)

    def _judge(self, now: float) -> None:
        for wid, r in self.ranks.items():
            mark = int(self.outstanding.overdue_s(wid, now) / REPORT_SILENCE_S) if r.dead_at is None else 0
            if mark != r.silence_mark:
                r.silence_mark = mark
                self.version += 1

    def _emit_rows(self, now: float, force: bool = False) -> None:
        live = sum(1 for r in self.ranks.values() if r.dead_at is None)
        for step in sorted(self.rows):
            reports, first, marks = self.rows[step]
            if force or len(reports) >= live or now - first >= LINGER_S:
                del self.rows[step]
                self._push(rows_of(step, reports), marks)

    def _finish(self, now: float) -> None:
        for cid, g in list(self.gathers.items()):
            flush_ready = all(f not in self.inflight for f in g.long_polls.values())
            if not g.waiting and flush_ready:
                if g.long_polls:
                    self._emit_rows(now, force=True)  # every step report so far goes before the answer
                faults = tuple(sorted(g.node_faults))
                self._push(CommandDone(cid, g.replies, g.errors, tuple(g.lost), self.state(now, news=False), faults))
                del self.gathers[cid]
            elif g.unsent:  # a rank failed: tell the driver now, the rest follows
                faults = tuple(sorted(g.node_faults))
                self._push(CommandDone(cid, {}, dict(g.errors), tuple(g.lost), self.state(now, news=False), faults))
                g.errors, g.lost, g.unsent, g.node_faults = {}, [], 0, set()

    def _push(self, item: Any, marks: dict[int, int] | None = None) -> None:
        self.seq += 1
        self.items.append((self.seq, item))
        if marks:
            self.marks[self.seq] = marks

    # ------------------------------------------------------------------ commands
    def command(self, cid: int, part: NodeCommand) -> None:
        if self.gone:
            return
        with self.cond:
            self._apply(cid, part)
            self.cond.notify_all()
        self.backend.wake()

    def _apply(self, cid: int, part: NodeCommand) -> None:
        if isinstance(part, Attach):
            for wid, (handle, rank) in part.ranks.items():
                self.ranks[wid] = _Rank(wid, handle, rank, since=part.since.get(wid, 0))
            self.version += 1
        elif isinstance(part, Detach):
            for wid in part.wids:
                self.ranks.pop(wid, None)
                self.polls.pop(wid, None)
                self.outstanding.forget(wid)
            for pid in part.pids:
                self.backend.end(pid)
            self.version += 1
        elif isinstance(part, NodeConfigure):
            for wid in part.requests:
                self._expect_new_run(wid, cid)
            self._gather(cid, {wid: Reconfigure(req) for wid, req in part.requests.items()})
        elif isinstance(part, Launch):
            for r in self._live():
                self._expect_new_run(r.wid, cid)
                self.backend.call(r.handle, Run(part.last_step))  # its end comes with a poll
        elif isinstance(part, Signal):
            for r in self._live():
                self.backend.call(r.handle, part.call)
        elif isinstance(part, Query):
            wids = part.wids if part.wids is not None else tuple(self.ranks)
            self._gather(cid, dict.fromkeys(wids, part.call))
        elif isinstance(part, Flush):
            self._flush(cid, part.wids if part.wids is not None else tuple(self.ranks))

    def _live(self) -> list[_Rank]:
        return [r for r in self.ranks.values() if r.dead_at is None]

    def _expect_new_run(self, wid: int, cid: int) -> None:
        r = self.ranks.get(wid)
        if r is not None:
            r.stale_upto, r.outcome, r.since = r.runs_seen, None, cid
            self.version += 1

    def _gather(self, cid: int, calls: dict[int, RankCall]) -> None:
        g = self.gathers[cid] = CallGather(cid, set(calls))
        for wid, call in calls.items():
            r = self.ranks.get(wid)
            if r is None or r.dead_at is not None:
                g.waiting.discard(wid)
                g.lost.append(wid)
                g.unsent += 1
                continue
            self.inflight[self.backend.call(r.handle, call)] = ("call", cid, wid)

    def _flush(self, cid: int, wids: tuple[int, ...]) -> None:
        """A short poll to each rank, which also sends back the long poll in flight: the
        answer goes up once both are in, after every report they carried."""
        g = self.gathers[cid] = CallGather(cid, set())
        for wid in wids:
            r = self.ranks.get(wid)
            if r is None or r.dead_at is not None:
                g.lost.append(wid)
                continue
            if wid in self.polls:
                g.long_polls[wid] = self.polls[wid]
            g.waiting.add(wid)
            self.inflight[self.backend.call(r.handle, Poll(0.0, r.ack, r.have))] = ("flush", cid, wid)

    # ------------------------------------------------------------------ the parent's long poll
    def digest(self, acks: dict[str, int] | None, wait_s: float, resend: bool = False, linger_s: float = 0.0) -> Digest:
        """Items after the last answer (after the ack, with ``resend``) and the node's news,
        as soon as there is any, else after ``wait_s``. ``acks``: node -> the last item the
        driver has (this node's entry frees what it covers). (``linger_s``: aggregators')"""
        if self.gone:
            raise AgentGone(self.node)
        ack = (acks or {}).get(self.node)
        with self.cond:
            if ack is not None and ack > self.acked:
                self.acked = ack
                self.items = [(s, i) for s, i in self.items if s > ack]
                for seq in [s for s in self.marks if s <= ack]:  # the workers may drop what the driver has
                    for wid, number in self.marks.pop(seq).items():
                        if wid in self.ranks:
                            self.ranks[wid].ack = max(self.ranks[wid].ack, number)
            if resend:
                self.sent, self.sent_version = self.acked, -1
            deadline = self.clock() + wait_s
            while not self.has_news():
                left = deadline - self.clock()
                if left <= 0:
                    break
                self.cond.wait(left)
            return self._answer(self.clock())

    def _answer(self, now: float) -> Digest:
        fresh = [(s, i) for s, i in self.items if s > self.sent]
        self.sent = max(self.sent, self.seq)
        news_changed = self.version != self.sent_version
        self.sent_version = self.version
        state = self.state(now)
        return Digest(
            seqs={self.node: self.sent},
            rows=[i for _, i in fresh if isinstance(i, StepRows)],
            items=[(self.node, s, i) for s, i in fresh if not isinstance(i, StepRows)],
            states={self.node: state} if news_changed else {},  # a change only (no news: it cleared)
            step=state.step,
        )

    def state(self, now: float, news: bool = True) -> NodeState:
        """The node as of ``now``: its live ranks, their newest step, and (``news``) the
        ranks with news."""
        if not news:
            return NodeState(self.node, len(self._live()), max((r.step for r in self.ranks.values()), default=0))
        with_news = []
        for r in self.ranks.values():
            if r.dead_at is None and r.outcome is None and not r.silence_mark:
                continue
            at = r.dead_at if r.dead_at is not None else r.outcome_at
            with_news.append(
                RankNews(
                    r.wid,
                    r.step,
                    outcome=r.outcome,
                    dead=r.dead_at is not None,
                    age_s=max(0.0, now - at),
                    silent_s=self.outstanding.overdue_s(r.wid, now) if r.dead_at is None else 0.0,
                    since=r.since,
                )
            )
        step = max((r.step for r in self.ranks.values()), default=0)
        return NodeState(self.node, len(self._live()), step, tuple(with_news))
