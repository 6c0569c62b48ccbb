"""The driver's end of the agent tree (``elastic/agent/``): its shape, its top-level
channels, and what one look at them brings in.

Where it runs: in the driver, for the worker group (``worker_group.py``), which turns what
comes in into members' news and failures. The tree:

* one ``NodeAgent`` per node; with at most ``FAN_IN`` nodes the agents are the driver's
  channels;
* beyond that, ``Aggregator``s of at most ``FAN_IN`` children each, in as many levels as keep
  the driver's channels at ``TOP_MAX`` or fewer (decided once, for the most nodes the job
  may span), so the driver's work per step grows with its channels, not with the ranks.

Every channel has one long poll in flight (``Digest``); its liveness is judged on
requests in flight and past due (``elastic/agent/liveness.py``), after every answer that
has arrived is taken in, so a driver that was busy blames nobody. Items are acked per node
with the next request, and an item seen twice (a replaced parent asks again) is dropped.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import ActorUnavailableError

from elastic.agent.aggregator import ACTOR_GONE, CHILD_WAIT_S
from elastic.agent.lifeline import LifelineServer
from elastic.agent.liveness import STARTUP_GRACE_S, Outstanding
from elastic.agent.ordered import Numbered
from elastic.messages import CommandDone, Digest, NodeCommand, NodeState, RankReport, StepRows

logger = logging.getLogger(__name__)

FAN_IN = 32  # children per aggregator
TOP_MAX = 8  # the driver's channels, when the tree has aggregators
CHANNEL_WAIT_S = CHILD_WAIT_S  # a channel's long poll: back at once with news, else after this
ROW_LINGER_SHARE = 0.1  # step rows may wait this share of a step in the top aggregators, to come up as one
ROW_LINGER_MAX_S = 0.25


@dataclass
class Taken:
    """What one look at the channels brought in."""

    rows: list[StepRows] = field(default_factory=list)
    reports: list[tuple[int, Any]] = field(default_factory=list)  # (rank, WorkerReport)
    done: list[tuple[str, CommandDone]] = field(default_factory=list)  # (node, answer)
    states: dict[str, NodeState] = field(default_factory=dict)  # node -> its changed state (no news: cleared)
    lost: dict[str, float] = field(default_factory=dict)  # tree key -> seconds unreachable (inf: died)
    step: int = 0


class StepPace:
    """Seconds per step as the driver sees the newest step go by (a moving average), and the
    linger it asks of its channels for step rows: rows are not urgent (news, commands' answers
    and deaths go up at once), so at 2 s steps the rows of thousands of nodes come up in one or
    two digests per step instead of a dozen pieces (issue 24: the driver's CPU per step)."""

    def __init__(self) -> None:
        self.step, self.at, self.step_s = 0, 0.0, 0.0

    def saw(self, step: int, now: float) -> None:
        if step < self.step or not self.at:  # the first step, or a rollback: start counting again
            self.step, self.at = step, now
        elif step > self.step:
            per = (now - self.at) / (step - self.step)
            self.step_s = per if not self.step_s else 0.8 * self.step_s + 0.2 * per
            self.step, self.at = step, now

    def linger_s(self) -> float:
        return min(ROW_LINGER_MAX_S, ROW_LINGER_SHARE * self.step_s)


@dataclass
class _Channel:
    key: str
    handle: Any
    request: Any = None
    resend: bool = True
    acks: dict[str, int] = field(default_factory=dict)  # to send with the next request
    started: bool = False  # it answered once (before that, its process may still be starting)


class AgentTree:
    """The shape of the tree and the driver's channels into it.

    ``make_agent(node)`` and ``make_aggregator()`` create the actors (the control-plane
    benchmark gives its own: virtual nodes' agents) and ``kill(handle)`` ends one (a unit
    test's recording handles are no actors)."""

    def __init__(
        self,
        make_agent: Callable[[str], Any],
        make_aggregator: Callable[[], Any],
        fan_in: int = FAN_IN,
        kill: Callable[[Any], None] = lambda handle: ray.kill(handle, no_restart=True),
    ):
        self.make_agent, self.make_aggregator, self.fan_in, self.kill = make_agent, make_aggregator, fan_in, kill
        self.handles: dict[str, Any] = {}  # tree key (node id or agg:N) -> actor handle (or a local factory)
        self.parent: dict[str, str | None] = {}  # tree key -> its parent's key (None: a channel)
        self.children: dict[str, set[str]] = {}  # aggregator key -> its children's keys
        self.nodes_under: dict[str, set[str]] = {}  # tree key -> the nodes below it (itself for an agent)
        self.levels: list[list[str]] = []  # aggregators by level, leaves first
        self.depth: int | None = None  # aggregator levels, decided at the first nodes
        self.channels: dict[str, _Channel] = {}
        self._channel: dict[str, str] = {}  # node -> the key of the channel it is under
        self.outstanding: Outstanding[str] = Outstanding()  # by tree key
        self.seen: dict[str, int] = {}  # node -> the last item seq taken in
        self.reports_seen: dict[int, int] = {}  # wid -> the worker's number of its last report taken in
        self.calls = 0  # Ray calls the driver made into the tree (for the control-plane benchmark)
        self.pace = StepPace()
        self.broken_at: dict[str, float] = {}  # channel -> when a call to it first failed since its last answer
        self.out = Numbered("driver")
        self._cids = itertools.count(1)
        self._agg_ids = itertools.count()
        self._lifelines: LifelineServer | None = None  # the channels' lifelines, made at the first actor channel
        self._ended: set[str] = set()  # channels whose lifeline ended: dead until replaced or removed

    # ------------------------------------------------------------------ shape
    def add_nodes(self, nodes: list[str], expected_nodes: int) -> list[str]:
        """Give every new node an agent in the tree; returns the new ones."""
        new = [n for n in dict.fromkeys(nodes) if n not in self.handles]
        if self.depth is None and new:
            self.depth = tree_depth(max(expected_nodes, len(new)), self.fan_in)
            self.levels = [[] for _ in range(self.depth)]
        refs: list[Any] = []
        for node in new:
            self.handles[node] = self.make_agent(node)
            self.nodes_under[node] = {node}
            refs += self._hang(node, level=0)
            self._channel[node] = self.chain(node)[-1]
        self._applied(refs)
        return new

    def _hang(self, key: str, level: int) -> list[Any]:
        """Put ``key`` (an agent at level 0, an aggregator at level k + 1) under a parent;
        returns the calls that do it."""
        if level >= (self.depth or 0):
            self.parent[key] = None
            self.channels[key] = _Channel(key, self.handles[key])
            self._link_lifeline(key)
            return []
        refs: list[Any] = []
        parent = next((k for k in self.levels[level] if len(self.children[k]) < self.fan_in), None)
        if parent is None:
            parent = f"agg:{next(self._agg_ids)}"
            self.handles[parent] = self.make_aggregator()
            self.children[parent], self.nodes_under[parent] = set(), set()
            self.levels[level].append(parent)
            refs += self._hang(parent, level + 1)
        self.parent[key] = parent
        self.children[parent].add(key)
        nodes = sorted(self.nodes_under[key])
        refs.append(self._call(parent, "adopt", key, self.handles[key], nodes))
        chain = self.chain(parent)
        for below, above in zip(chain, chain[1:]):  # every aggregator above routes these nodes down
            refs.append(self._call(above, "route", below, nodes))
        for k in chain:
            self.nodes_under[k] |= self.nodes_under[key]
        return refs

    def _link_lifeline(self, key: str) -> None:
        """Ask the channel ``key``'s actor to hold a lifeline to the driver (``lifeline.py``):
        its process's end is then seen at once, not when Ray's call to it gives up."""
        handle = self.handles[key]
        if not isinstance(handle, ray.actor.ActorHandle):
            return  # a unit test's recording handle
        if self._lifelines is None:
            self._lifelines = LifelineServer(ray.util.get_node_ip_address())
        handle.lifeline.remote(self._lifelines.address, self._lifelines.ticket(key))
        self.calls += 1

    def _call(self, key: str, method: str, *args: Any) -> Any:
        """A control call to ``key``'s actor, numbered so that it applies in order (``ordered.py``)."""
        self.calls += 1
        return getattr(self.handles[key], method).remote(self.out.name, self.out.next(key), *args)

    def _applied(self, refs: list[Any]) -> None:
        """Wait until changes of the tree's shape are applied (a command sent later could
        otherwise reach an aggregator before the route it needs). A new actor may first have
        to start."""
        refs = [r for r in refs if r is not None]
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=STARTUP_GRACE_S)

    def chain(self, key: str | None) -> list[str]:
        """``key`` and its ancestors."""
        out = []
        while key is not None:
            out.append(key)
            key = self.parent.get(key)
        return out

    def channel_of(self, node: str) -> str | None:
        return self._channel.get(node)

    def replace(self, key: str) -> Any:
        """A new actor for ``key`` (its node lives, or it is an aggregator), linked where the old
        one was; an aggregator's children are handed over. Returns the new handle."""
        old = self.handles[key]
        try:
            self.kill(old)
        except Exception as exc:  # noqa: BLE001 - already gone
            logger.debug("kill of %s failed: %s", key, exc)
        new = self.make_agent(key) if key in self.nodes_under and key not in self.children else self.make_aggregator()
        self.handles[key] = new
        self.out.forget(key)
        refs = [
            self._call(key, "adopt", c, self.handles[c], sorted(self.nodes_under[c]))
            for c in self.children.get(key, ())
        ]
        parent = self.parent.get(key)
        if parent is None:
            self.channels[key] = _Channel(key, new)
            self.outstanding.forget(key)
            self.broken_at.pop(key, None)
            self._ended.discard(key)
            self._link_lifeline(key)
        else:
            refs.append(self._call(parent, "adopt", key, new, sorted(self.nodes_under[key])))
        self._applied(refs)
        return new

    def remove_node(self, node: str) -> None:
        """A node that left: its agent goes, and no aggregator routes to it any more."""
        if node not in self.handles:
            return
        handle = self.handles.pop(node)
        try:
            self.kill(handle)
        except Exception as exc:  # noqa: BLE001 - gone with its node
            logger.debug("kill of the agent of %s failed: %s", node, exc)
        parent = self.parent.pop(node, None)
        self.nodes_under.pop(node, None)
        self._channel.pop(node, None)
        self.seen.pop(node, None)
        self._ended.discard(node)
        if self._lifelines is not None:
            self._lifelines.forget(node)
        if parent is None:
            self.channels.pop(node, None)
            self.outstanding.forget(node)
            return
        self.children[parent].discard(node)
        for k in self.chain(parent):
            self.nodes_under[k].discard(node)
            self._call(k, "disown", [node])

    def agent_count(self) -> int:
        return sum(1 for k in self.handles if k not in self.children)

    def shutdown(self) -> None:
        for key, handle in self.handles.items():
            try:
                self.kill(handle)
            except Exception as exc:  # noqa: BLE001 - already gone
                logger.debug("kill of %s failed: %s", key, exc)
        self.handles.clear()
        self.channels.clear()
        if self._lifelines is not None:
            self._lifelines.close()
            self._lifelines = None

    # ------------------------------------------------------------------ commands
    def send(self, parts: Mapping[str, NodeCommand]) -> int:
        """One command down the tree: one call per channel over the nodes addressed."""
        cid = next(self._cids)
        by_channel: dict[str, dict[str, NodeCommand]] = {}
        for node, part in parts.items():
            ch = self.channel_of(node)
            if ch is not None:
                by_channel.setdefault(ch, {})[node] = part
        for ch, sub in by_channel.items():
            self._call(ch, "command", cid, sub)
        return cid

    def resend(self, cid: int, parts: Mapping[str, NodeCommand]) -> None:
        """The parts of command ``cid`` again (a replaced agent did not get them)."""
        for node, part in parts.items():
            ch = self.channel_of(node)
            if ch is not None:
                self._call(ch, "command", cid, {node: part})

    # ------------------------------------------------------------------ a look
    def look(self, timeout_s: float) -> Taken:
        """Wait up to ``timeout_s`` for the first answer, then take in every answer that is in."""
        now = time.monotonic()
        for ch in self.channels.values():
            if ch.request is None:
                ch.request = ch.handle.digest.remote(ch.acks or None, CHANNEL_WAIT_S, ch.resend, self.pace.linger_s())
                self.calls += 1
                ch.acks, ch.resend = {}, False
                if not self.outstanding.in_flight(ch.key):
                    grace = 0.0 if ch.started else STARTUP_GRACE_S
                    self.outstanding.issued(ch.key, now, CHANNEL_WAIT_S + grace)
        refs = [ch.request for ch in self.channels.values()]
        taken = Taken()
        if not refs:
            time.sleep(timeout_s)
            return taken
        ready, _ = ray.wait(refs, num_returns=1, timeout=timeout_s)
        if ready:  # every other answer that is in, in the same call
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        ready_set = set(ready)
        for ch in list(self.channels.values()):
            if ch.request in ready_set:
                ref, ch.request = ch.request, None
                self._take(ch, ref, taken)
        if self._lifelines is not None:
            for key, at in self._lifelines.closed().items():  # its process is gone (lifeline.py)
                if key in self.channels:
                    logger.debug("channel %s: lifeline ended", key)
                    self.broken_at.setdefault(key, at)
                    self._ended.add(key)
                    self.outstanding.forget(key)
        for key in self._ended:  # dead until replaced or removed (Ray's own word may take a second)
            taken.lost[key] = math.inf
        now = time.monotonic()
        if taken.step:
            self.pace.saw(taken.step, now)
        for key, seconds in self.outstanding.silent(now, 0.0).items():
            if seconds > 0:
                taken.lost[key] = max(seconds, taken.lost.get(key, 0.0))
        return taken

    def _take(self, ch: _Channel, ref: Any, taken: Taken) -> None:
        try:
            d: Digest = ray.get(ref, timeout=0)
        except ActorUnavailableError:  # asked again; silent from now (a dead node's agent: probed soon)
            now = time.monotonic()
            self.outstanding.unreachable(ch.key, now)
            self.broken_at.setdefault(ch.key, now)
            logger.debug("channel %s unreachable", ch.key)
            return
        except ACTOR_GONE:  # died, killed for memory, or its replacement's node left meanwhile
            self.broken_at.setdefault(ch.key, time.monotonic())
            logger.debug("channel %s died", ch.key)
            taken.lost[ch.key] = math.inf
            self.outstanding.forget(ch.key)
            return
        self.outstanding.answered(ch.key)
        self.broken_at.pop(ch.key, None)
        ch.started = True
        ch.acks.update(d.seqs)
        taken.rows.extend(d.rows)
        for node, seq, item in d.items:
            if seq <= self.seen.get(node, 0):
                continue  # seen before: a replaced parent asked again
            if isinstance(item, RankReport):
                if item.seq and item.seq <= self.reports_seen.get(item.wid, 0):
                    continue  # a replaced agent sent it again
                self.reports_seen[item.wid] = max(item.seq, self.reports_seen.get(item.wid, 0))
                taken.reports.append((item.rank, item.report))
            elif isinstance(item, CommandDone):
                taken.done.append((node, item))
        for node, seq in d.seqs.items():
            self.seen[node] = max(seq, self.seen.get(node, 0))
        taken.states.update(d.states)
        taken.lost.update(d.lost)
        taken.step = max(taken.step, d.step)


def tree_depth(nodes: int, fan_in: int, top_max: int = TOP_MAX) -> int:
    """Aggregator levels for ``nodes`` agents: none while the driver can take every agent
    itself (``fan_in`` or fewer), else the fewest that leave ``top_max`` channels or fewer."""
    if nodes <= fan_in:
        return 0
    depth, channels = 1, math.ceil(nodes / fan_in)
    while channels > top_max:
        depth, channels = depth + 1, math.ceil(channels / fan_in)
    return depth
