"""An aggregator: one merged digest for a bounded number of children (agents or aggregators).

Where it runs: in an ``Aggregator`` actor on the driver's node (``actors.py``). Its thread
keeps one digest request in flight per child and takes the answers in; the parent's long
poll gets the merged buffer: every step's rows as one block, the other items as they came,
the news of every node below, and the children it cannot reach (``lost``, by child key: a
node id for an agent, ``agg:...`` for an aggregator). Commands are split by child and
passed on in the order they came.

A child that is local (the control-plane benchmark's virtual nodes,
``elastic/testing/virtual_nodes.py``) is a ``NodeCore`` in this process. It is asked
without waiting, in this thread, when it has news (it rings this aggregator's bell when
its pump makes some) or after ``child_wait_s`` of quiet, so hosting hundreds of them
takes no thread each.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import ActorUnavailableError, ActorUnschedulableError, OutOfMemoryError, RayActorError

from elastic.agent.bell import Doorbell
from elastic.agent.liveness import STARTUP_GRACE_S, Outstanding
from elastic.agent.node import LINGER_S, REPORT_SILENCE_S, AgentGone
from elastic.agent.ordered import Numbered
from elastic.agent.rows import merge_rows
from elastic.messages import Digest, NodeCommand, NodeState, StepRows

# What a call to an agent or aggregator raises when its process is gone: it died, its node
# left (unschedulable), or Ray's memory monitor killed it (OutOfMemoryError is not a
# RayActorError: it reached fit() and failed the job, seen at 100M parameters on this host).
ACTOR_GONE = (RayActorError, ActorUnschedulableError, OutOfMemoryError)

logger = logging.getLogger(__name__)

CHILD_WAIT_S = 1.0  # a child's long poll: back at once with news, else after this


@dataclass
class _Child:
    key: str
    handle: Any  # an actor handle, or a local NodeCore
    nodes: set[str]
    local: bool
    request: Any = None  # the digest call in flight (an ObjectRef; a done Future for a local child)
    resend: bool = True  # the next request asks for everything not acked yet (a new link)
    lost: dict[str, float] = field(default_factory=dict)  # what it reports lost below it
    silence_mark: int = 0
    started: bool = False  # it answered once (before that, its process may still be starting)
    quiet_until: float = 0.0  # a local child: asked again by then even without news


class AggregatorCore:
    def __init__(self, bell: Doorbell, clock=time.monotonic, child_wait_s: float = CHILD_WAIT_S):
        self.bell, self.clock, self.child_wait_s = bell, clock, child_wait_s
        self.children: dict[str, _Child] = {}
        self.routes: dict[str, str] = {}  # node -> the key of the child it is under
        self.acks: dict[str, int] = {}  # node -> the last item the driver has
        self.outstanding: Outstanding[str] = Outstanding()  # by child key
        self.dead: dict[str, float] = {}  # child key -> when its actor died
        self.rows: list[StepRows] = []
        self.first_row_at: float | None = None
        self.items: list[tuple[str, int, Any]] = []
        self.seqs: dict[str, int] = {}
        self.states: dict[str, NodeState] = {}  # the last state of every node below
        self.dirty: set[str] = set()  # nodes whose state the parent has not had yet
        self.step = 0
        self.version = self.sent_version = 0
        self.cond = threading.Condition()
        self.out = Numbered(f"agg-{uuid.uuid4().hex[:12]}")  # this aggregator's calls to its children

    # ------------------------------------------------------------------ membership
    def adopt(self, key: str, handle: Any, nodes: list[str], local: bool = False) -> None:
        """Add (or replace) the child ``key``, and route ``nodes`` to it."""
        with self.cond:
            self.children[key] = _Child(key, handle, set(nodes), local)
            self.out.forget(key)
            for n in nodes:
                old = self.routes.get(n)
                if old is not None and old != key and old in self.children:
                    self.children[old].nodes.discard(n)
                self.routes[n] = key
            self.dead.pop(key, None)
            self.outstanding.forget(key)
            self.version += 1
        if local:
            handle.on_news = self.bell.ring
        self.bell.ring()

    def route(self, key: str, nodes: list[str]) -> None:
        """``nodes`` (new below the child ``key``) are reached through it."""
        with self.cond:
            child = self.children.get(key)
            if child is not None:
                child.nodes |= set(nodes)
                self.routes.update(dict.fromkeys(nodes, key))

    def disown(self, nodes: list[str]) -> list[str]:
        """Stop routing ``nodes`` (their agents are gone for good); a child left empty goes.
        Returns the keys of the children that went."""
        gone: list[str] = []
        with self.cond:
            for n in nodes:
                key = self.routes.pop(n, None)
                self.states.pop(n, None)
                self.acks.pop(n, None)
                child = self.children.get(key) if key is not None else None
                if key is not None and child is not None:
                    child.nodes.discard(n)
                    if not child.nodes:
                        del self.children[key]
                        self.dead.pop(key, None)
                        self.outstanding.forget(key)
                        gone.append(key)
            self.version += 1
        return gone

    def child_gone(self, key: str) -> None:
        """The lifeline of the child ``key`` ended (``lifeline.py``): its process is gone, so it
        counts as dead now, not when Ray's call to it gives up."""
        with self.cond:
            child = self.children.get(key)
            if child is None or child.local or key in self.dead:
                return
            self.dead[key] = self.clock()
            self.outstanding.forget(key)
            self.version += 1
            self.cond.notify_all()
        self.bell.ring()

    # ------------------------------------------------------------------ the loop
    def pump(self, timeout_s: float) -> None:
        with self.cond:
            now = self.clock()
            self._ask(now)
            refs = [c.request for c in self.children.values() if not c.local and c.request is not None]
            local = [c for c in self.children.values() if c.local and c.key not in self.dead]
            dues = [0.0 if c.request is not None else c.quiet_until for c in local]  # asked: taken at once
            due = self.outstanding.next_deadline(REPORT_SILENCE_S)
            if due is not None:
                dues.append(due)
            if dues:
                timeout_s = max(0.0, min(timeout_s, min(dues) - now))
        ready = set(self.bell.wait(refs, timeout_s))
        with self.cond:
            now = self.clock()
            for c in list(self.children.values()):
                req = c.request
                if req is not None and (req.done() if c.local else req in ready):
                    c.request = None
                    self._take(c, req, now)
            self._judge(now)
            self.cond.notify_all()

    def _ask(self, now: float) -> None:
        for c in self.children.values():
            if c.request is not None or c.key in self.dead:
                continue
            acks = {n: self.acks[n] for n in c.nodes if n in self.acks}
            if c.local:
                if not (c.resend or now >= c.quiet_until or c.handle.has_news()):
                    continue
                c.request, c.quiet_until = _answered(c.handle.digest, acks, 0.0, c.resend), now + self.child_wait_s
            else:
                c.request = c.handle.digest.remote(acks, self.child_wait_s, c.resend)
            c.resend = False
            if not self.outstanding.in_flight(c.key):  # a retried request keeps its first due time
                grace = 0.0 if c.started or c.local else STARTUP_GRACE_S
                self.outstanding.issued(c.key, now, self.child_wait_s + grace)

    def _take(self, c: _Child, req: Any, now: float) -> None:
        try:
            d = req.result() if isinstance(req, Future) else ray.get(req, timeout=0)
        except (AgentGone, *ACTOR_GONE) as exc:
            if isinstance(exc, ActorUnavailableError):  # unreachable: asked again, silent from now
                self.outstanding.unreachable(c.key, now)
                return
            self.dead[c.key] = now
            self.outstanding.forget(c.key)
            self.version += 1
            return
        except Exception as exc:  # noqa: BLE001 - asked again; its silence keeps counting
            logger.warning("digest of %s failed: %s", c.key, exc)
            return
        self.outstanding.answered(c.key)
        c.started = True
        self._merge(c, d, now)

    def _merge(self, c: _Child, d: Digest, now: float) -> None:
        if d.rows:
            self.rows.extend(d.rows)
            self.first_row_at = self.first_row_at if self.first_row_at is not None else now
        changed = bool(d.items)
        self.items.extend(d.items)
        for n, s in d.seqs.items():
            self.seqs[n] = max(s, self.seqs.get(n, 0))
        for n, state in d.states.items():  # changes only: what the parent has not seen yet
            if self.states.get(n) != state:
                self.states[n] = state
                self.dirty.add(n)
                changed = True
        changed = changed or c.lost != d.lost
        c.lost = dict(d.lost)
        self.step = max(self.step, d.step)
        if changed:
            self.version += 1

    def _judge(self, now: float) -> None:
        for c in self.children.values():
            mark = int(self.outstanding.overdue_s(c.key, now) / REPORT_SILENCE_S)
            if mark != c.silence_mark:
                c.silence_mark = mark
                self.version += 1

    def lost(self, now: float) -> dict[str, float]:
        """Child keys that cannot be reached, and for how long (``inf``: the actor died)."""
        out: dict[str, float] = {}
        for c in self.children.values():
            out.update(c.lost)
            if c.key in self.dead:
                out[c.key] = math.inf
            elif c.silence_mark:
                out[c.key] = self.outstanding.overdue_s(c.key, now)
        return out

    # ------------------------------------------------------------------ the parent's long poll
    def digest(self, acks: dict[str, int] | None, wait_s: float, resend: bool = False, linger_s: float = 0.0) -> Digest:
        """Back at once with news (items, changed states, losses), with step rows once the
        first of them has waited ``max(LINGER_S, linger_s)`` (the parent's choice), else after
        ``wait_s``."""
        linger_s = max(LINGER_S, linger_s)
        with self.cond:
            if acks:
                self.acks.update({n: s for n, s in acks.items() if n in self.routes})
            if resend:
                for c in self.children.values():
                    c.resend = True
                self.sent_version = -1
                self.dirty |= set(self.states)
            deadline = self.clock() + wait_s
            while True:
                now = self.clock()
                urgent = bool(self.items) or self.version != self.sent_version
                rows_due = self.first_row_at is not None and now - self.first_row_at >= linger_s
                if urgent or rows_due or now >= deadline:
                    break
                until = deadline if self.first_row_at is None else min(deadline, self.first_row_at + linger_s)
                self.cond.wait(max(0.0, until - now))
            out = Digest(
                seqs=self.seqs,
                rows=merge_rows(self.rows),
                items=self.items,
                states={n: self.states[n] for n in self.dirty if n in self.states},
                lost=self.lost(now),
                step=self.step,
            )
            self.rows, self.items, self.seqs, self.first_row_at = [], [], {}, None
            self.dirty.clear()
            self.sent_version = self.version
            return out

    # ------------------------------------------------------------------ commands
    def command(self, cid: int, parts: dict[str, NodeCommand]) -> None:
        """Pass each node's part to the child it is under (in the order commands came)."""
        by_child: dict[str, dict[str, NodeCommand]] = {}
        with self.cond:
            for node, part in parts.items():
                key = self.routes.get(node)
                if key is not None and key not in self.dead:
                    by_child.setdefault(key, {})[node] = part
            targets = [(self.children[k], sub) for k, sub in by_child.items()]
        for child, sub in targets:
            if child.local:
                for part in sub.values():
                    child.handle.command(cid, part)
            else:
                child.handle.command.remote(self.out.name, self.out.next(child.key), cid, sub)


def _answered(call: Any, *args: Any) -> Future:
    """``call(*args)`` made now, as a done future (its result or its exception)."""
    f: Future = Future()
    try:
        f.set_result(call(*args))
    except BaseException as exc:  # noqa: BLE001 - handed to the taker like a remote call's
        f.set_exception(exc)
    return f
