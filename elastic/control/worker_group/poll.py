"""What the worker group learns from the agent tree, and what it does about a lost agent
(driver side): ``GroupPoll``, which the group looks through and sends its commands by.

Each look at the tree (``agent_link.AgentTree.look``) brings step rows and reports (kept
for the controller), answers to commands (gathered by command id), and news of ranks: a
``run()`` that ended, an actor that died, a poll past due. News is applied to the members
it names, by worker id; a member with news is *notable*, and only then does the diagnosis
read every member, so a look costs the driver O(channels + news), not O(ranks).

An agent that cannot be reached is judged by its node's raylet: refused, the node is lost
(its ranks are dead); alive, an agent that died (or stayed silent for
``elastic.heartbeat_timeout_s``, when its ranks would count as silent) is replaced and given
its ranks again, and the job goes on. A lost aggregator is replaced likewise.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from elastic.control.agent_link import AgentTree, Taken
from elastic.control.diagnosis import PEER_GRACE_S, RayletProbe
from elastic.control.worker_group.state import GroupState
from elastic.messages import Attach, CommandDone, NodeCommand, NodeConfigure, NodeState

logger = logging.getLogger(__name__)


@dataclass
class Gather:
    """The answers to one command, from the nodes it addressed."""

    cid: int
    parts: dict[str, NodeCommand]
    expect: dict[str, set[int]]  # node -> the worker ids it must answer for
    replies: dict[int, Any] = field(default_factory=dict)
    errors: dict[int, str] = field(default_factory=dict)
    node_faults: set[int] = field(default_factory=set)  # of ``errors``: their node failed them (a full disk)
    lost: set[int] = field(default_factory=set)
    states: dict[str, NodeState] = field(default_factory=dict)
    answered: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.total = sum(len(ws) for ws in self.expect.values())

    def add(self, node: str, done: CommandDone) -> None:
        self.replies.update(done.replies)
        self.errors.update(done.errors)
        self.node_faults.update(done.node_faults)
        self.lost.update(done.lost)
        self.answered |= done.replies.keys() | done.errors.keys() | set(done.lost)
        if done.state is not None:
            self.states[node] = done.state

    def lose(self, wids: set[int]) -> None:
        new = wids - self.answered
        self.lost |= new
        self.answered |= new

    def complete(self) -> bool:
        return len(self.answered) >= self.total

    def missing(self) -> set[int]:
        return {w for ws in self.expect.values() for w in ws if w not in self.answered}

    def failed(self) -> bool:
        return bool(self.errors or self.lost)


class GroupPoll:
    """The group's end of the agent tree: each look applied to the members (``GroupState``),
    the answers to commands gathered, lost agents and aggregators judged and replaced."""

    def __init__(self, tree: AgentTree, raylets: RayletProbe, state: GroupState, heartbeat_timeout_s: float):
        self.tree = tree
        self.raylets = raylets
        self.state = state
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._inbox: list[tuple[int, Any]] = []  # (rank, report) taken in, not yet handed to the controller
        self._news_nodes: set[str] = set()
        self._unreachable: dict[str, float] = {}  # tree key -> seconds out of reach, as of the last look
        self._died: dict[str, float] = {}  # agent key -> when the driver saw it dead with its raylet answering
        self._gathers: dict[int, Gather] = {}
        self._configuring = False  # a configure is in flight

    @contextmanager
    def configuring(self) -> Iterator[None]:
        """While the group re-forms: silence is not acted on (death is)."""
        self._configuring = True
        try:
            yield
        finally:
            self._configuring = False

    def take(self) -> list[tuple[int, Any]]:
        """The reports taken in since the last ``take``."""
        taken, self._inbox = self._inbox, []
        return taken

    # ------------------------------------------------------------------ a look
    def look(self, timeout_s: float) -> float:
        """One look at the tree, applied; returns the driver clock when it was taken in."""
        taken = self.tree.look(timeout_s)
        now = time.monotonic()
        self._apply(taken, now)
        return now

    def _apply(self, taken: Taken, now: float) -> None:
        self._inbox.extend((-1, rows) for rows in taken.rows)
        self._inbox.extend(taken.reports)
        for node, done in taken.done:
            g = self._gathers.get(done.cid)
            if g is not None:
                g.add(node, done)
        for state in taken.states.values():  # changes only: a state without news clears the node's
            if state.news:
                self._apply_state(state, now)
            elif state.node in self._news_nodes:
                self._clear_news(state.node)
        self._unreachable = dict(taken.lost)
        if taken.lost or self._died:  # an agent in its grace is judged again at every look
            self._supervise({**dict.fromkeys(self._died, math.inf), **taken.lost})

    def _apply_state(self, state: NodeState, now: float) -> None:
        self._news_nodes.add(state.node)
        for news in state.news:
            m = self.state.by_wid.get(news.wid)
            if m is None:
                continue
            m.step = max(m.step, news.step)
            m.silent_s = news.silent_s
            if news.dead and not m.dead:
                m.dead = True
                m.returned_at = now - news.age_s
            if news.outcome is not None and m.run_result is None and news.since >= m.since:
                m.run_result, m.returned_at = news.outcome, now - news.age_s
                m.quiet = True  # its reports came up with (or before) this news
            self.state.notable.add(m.wid)

    def _clear_news(self, node: str) -> None:
        self._news_nodes.discard(node)
        for m in self.state.on_node(node):
            m.silent_s = 0.0

    # ------------------------------------------------------------------ liveness as the diagnosis reads it
    def evidence(self) -> bool:
        """Is there anything for the diagnosis to read? (else it is not run: O(news) per look)"""
        for m in self.state.notable_members():
            if m.dead or m.run_result is not None or m.silent_s >= PEER_GRACE_S:
                return True
        return any(s >= PEER_GRACE_S for s in self._unreachable.values())

    def out_of_reach(self, nodes: set[str]) -> set[str]:
        """Those of ``nodes`` whose agent, or a link above it, is unanswered or dead."""
        bad = set(self._unreachable) | set(self.tree.broken_at) | set(self._died)
        if not bad:
            return set()
        return {n for n in nodes if n not in self.tree.handles or any(k in bad for k in self.tree.chain(n))}

    def refresh_last_ok(self, now: float) -> None:
        """Each member's ``last_ok`` as the diagnosis reads it: now, less how long it has been
        out of reach (its own poll past due, or its agent's or an aggregator's answer)."""
        reach, broken = self._unreachable, self.tree.broken_at
        chain_silence: dict[str, float] = {}
        for m in self.state.members:
            s = chain_silence.get(m.node_id)
            if s is None:
                # a dead link: silent since its first failed call (0 when the driver never saw one)
                ks = [reach.get(k, 0.0) if math.isfinite(reach.get(k, 0.0)) else now - broken.get(k, now)
                      for k in self.tree.chain(m.node_id)]  # fmt: skip
                s = chain_silence[m.node_id] = max(ks, default=0.0)
            m.last_ok = now - max(m.silent_s, s)

    # ------------------------------------------------------------------ lost agents and aggregators
    def _supervise(self, lost: dict[str, float]) -> None:
        for key, seconds in lost.items():
            if key not in self.tree.handles:
                self._died.pop(key, None)
                continue
            is_agent = key not in self.tree.children
            if is_agent and (seconds >= PEER_GRACE_S or key in self.tree.broken_at):  # (a failed call: at once)
                gone = self.raylets.dead({key}, wait_s=0.0, refused_only=not math.isinf(seconds))
                logger.debug("agent %s out of reach %.3fs: raylet %s", key, seconds, "gone" if gone else "answers")
                if gone:
                    self._died.pop(key, None)
                    self._node_lost(key)
                    continue
                # A dead agent whose raylet still answers: its node may be going down (a kill
                # takes the node's processes first, its raylet next), so its raylet is asked
                # again at each look for a grace before the agent is replaced on that node.
                now = time.monotonic()
                if math.isinf(seconds) and now - self._died.setdefault(key, now) < PEER_GRACE_S:
                    continue
            # Silence is not acted on while the group re-forms (its ranks' work starves the
            # agents of CPU on a small host; the configure has its own timeout), death is.
            if math.isinf(seconds) or (seconds >= self.heartbeat_timeout_s and not self._configuring):
                what = "the agent of node" if is_agent else "aggregator"
                logger.warning(
                    "%s %s %s: replaced", what, key, "died" if math.isinf(seconds) else f"silent {seconds:.1f}s"
                )
                self._died.pop(key, None)
                self.tree.replace(key)
                self._relink(key)
                self._unreachable.pop(key, None)  # its ranks are judged by the new one

    def _node_lost(self, node: str) -> None:
        """Its agent is gone and its raylet refuses: every rank there is dead."""
        for m in self.state.on_node(node):
            if not m.dead:
                m.dead = True
                m.returned_at = time.monotonic()
                self.state.notable.add(m.wid)
        self.tree.remove_node(node)

    def _relink(self, key: str) -> None:
        """A new agent (or aggregator) for ``key``: a new agent is given its node's live ranks
        again; the queries below it are asked again (a configure in flight through a lost
        agent is lost: its ranks' answers went to the old one)."""
        nodes = self.tree.nodes_under.get(key, set())
        if key not in self.tree.children:
            live = [m for m in self.state.on_node(key) if not m.dead]
            if live:
                self.tree.send({key: Attach({m.wid: (m.actor, m.rank) for m in live}, {m.wid: m.since for m in live})})
        for g in self._gathers.values():
            parts = {n: p for n, p in g.parts.items() if n in nodes}
            if not parts:
                continue
            if any(isinstance(p, NodeConfigure) for p in parts.values()):
                if key in nodes:
                    g.lose({w for n in parts for w in g.expect.get(n, ())})
                continue
            self.tree.resend(g.cid, parts)

    # ------------------------------------------------------------------ commands and their answers
    def command(self, parts: dict[str, NodeCommand], expect: dict[str, set[int]] | None = None) -> Gather:
        cid = self.tree.send(parts)
        g = self._gathers[cid] = Gather(cid, parts, expect or {})
        return g

    def wait_for(self, g: Gather, timeout_s: float, until_failure: bool = False) -> Gather:
        """Look until every expected answer is in (a dead member counts as lost), a failure
        with ``until_failure``, or ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        expected = {w for ws in g.expect.values() for w in ws}
        try:
            while True:
                g.lose({w for w in self.state.notable if w in expected and self.state.by_wid[w].dead})
                if g.complete() or (until_failure and g.failed()):
                    return g
                left = deadline - time.monotonic()
                if left <= 0:
                    return g
                self.look(min(left, 0.1))
        finally:
            if g.complete():
                self._gathers.pop(g.cid, None)

    def done(self, g: Gather) -> None:
        self._gathers.pop(g.cid, None)
