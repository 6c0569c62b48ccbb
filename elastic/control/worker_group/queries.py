"""The worker group's questions to its ranks through the agent tree, and the commands that
interrupt their step (driver side; a part of ``WorkerGroup``, split out by concern): the
snapshot holdings a recovery plans with, the reports not taken in yet, checkpoints after a
stop, and the abort of the step in flight, which asks the holdings with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from elastic.control.recovery_plan import Holdings
from elastic.control.worker_group.poll import Gather, GroupNews, wids_by_node
from elastic.messages import NodeCommand, Query, Signal, links_to

if TYPE_CHECKING:
    from elastic.control.worker_group.worker import Member

SNAPSHOT_QUERY_S = 10.0  # how long the snapshot holdings query waits for answers, in all


class GroupQueries(GroupNews):
    """Fields set by ``WorkerGroup.__init__`` (and ``GroupNews``'s)."""

    _holdings_ahead: tuple[frozenset[int], Gather] | None  # asked with an abort (abort_steps)
    _generation: int  # of the process group now formed (the one an abort abandons)

    def snapshot_holdings(self, members: Sequence[Member]) -> list[Holdings | None]:
        """Each member's memory-tier holdings; None for one that is gone or silent.

        Members on a node whose raylet refuses connections are not asked: a call to an
        actor on a lost node can hang until Ray notices the loss. Only nodes out of reach
        (their agent, or a link above it, unanswered or dead) are probed: every other node
        answered the tree just now (at 16k ranks, probing every raylet was a quarter of a
        second of the recovery's decision).
        """
        gone = self.raylets.dead(self._out_of_reach({m.node_id for m in members}), wait_s=0.0)
        asked = [m for m in members if m.node_id not in gone and not m.dead]
        ahead, self._holdings_ahead = self._holdings_ahead, None
        wanted = {m.wid for m in asked}
        if ahead is not None and wanted <= ahead[0]:
            g = ahead[1]  # asked with the abort of the step: answered as each run ended
            g.lose(set(ahead[0]) - wanted)  # killed or left out since: not waited for
        else:
            if ahead is not None:
                self._done(ahead[1])
            expect = wids_by_node(asked)
            g = self._command({n: Query("snapshot_holdings", tuple(ws)) for n, ws in expect.items()}, expect)
        self._wait_for(g, SNAPSHOT_QUERY_S)
        self._done(g)
        return [g.replies.get(m.wid) for m in members]

    def drain_results(self, members: Sequence[Member], timeout: float = 10.0) -> list[tuple[int, Any]]:
        """The results ``members`` reported that the controller has not seen yet: every
        agent sends up all its ranks reported before it answers. A member whose run ended
        with nothing asked of it since is not asked: all it reported came with its end."""
        expect = wids_by_node([m for m in members if not m.dead and not m.quiet])
        g = self._command({n: Query("flush", tuple(ws)) for n, ws in expect.items()}, expect)
        self._wait_for(g, timeout)
        self._done(g)
        for node, state in g.states.items():
            for m in self._members_on(node) if state.step > 0 else ():
                m.step = max(m.step, state.step)
        taken, self._inbox = self._inbox, []
        return taken

    def save_checkpoints(self, timeout: float) -> None:
        """After a stop at a step boundary: every rank writes the live step to storage."""
        live = [m for m in self.members if not m.dead]
        for m in live:
            m.quiet = False  # its checkpoint's upload reports come after its run's end
        expect = wids_by_node(live)
        g = self._command({n: Query("save_checkpoint", tuple(ws), timeout) for n, ws in expect.items()}, expect)
        self._wait_for(g, timeout)
        self._done(g)

    def abort_steps(self, members: Sequence[Member], lost: Sequence[Member] = ()) -> None:
        """A peer was lost: every member leaves the step in flight at its next block (fire
        and forget, through the members' node agents: one message per aggregator link, not
        one actor call per rank from the driver), and shuts down its links to the ``lost``
        ranks (their connections, seen from the other end: ``links_to``).

        The recovery's next question goes down with it: each member's snapshot holdings as
        of the end of its run (``TrainWorker.snapshot_holdings(after_run_s)``), so they come
        up with the runs' ends and ``snapshot_holdings`` finds them in, instead of asking
        after every run has ended (a round trip of the tree: at 16k ranks, tenths of a
        second of the recovery's decision)."""
        by_node = wids_by_node(members)
        links = links_to(c for m in lost for c in m.connections)
        self.tree.send(dict.fromkeys(by_node, Signal("abort_step", self._generation, links)))
        if self._holdings_ahead is not None:
            self._done(self._holdings_ahead[1])
        query: dict[str, NodeCommand] = {
            n: Query("snapshot_holdings", tuple(ws), timeout_s=SNAPSHOT_QUERY_S) for n, ws in by_node.items()
        }
        self._holdings_ahead = (frozenset(m.wid for m in members), self._command(query, by_node))
