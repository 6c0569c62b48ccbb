"""The Ray actors of the agent tree: ``NodeAgent`` (one per node) and ``Aggregator``.

Thin shells: the logic is in ``node.py`` and ``aggregator.py``. Each actor runs its core's
loop in a thread of its own and answers three kinds of calls in separate concurrency
groups, so that none waits behind another: ``digest`` (its parent's long poll),
``command`` (in the order they came) and ``bell`` (its own doorbell, ``bell.py``). Both ask
for no CPU: they host nothing heavy, and a node's training workers keep its cores.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any, cast

import ray

if TYPE_CHECKING:
    from ray.actor import ActorClass

from elastic.agent.aggregator import CHILD_WAIT_S, AggregatorCore
from elastic.agent.bell import Doorbell
from elastic.agent.lifeline import LifelineServer, hold
from elastic.agent.node import POLL_WAIT_S, AgentGone, NodeCore
from elastic.agent.ordered import InOrder
from elastic.agent.ranks import ActorRanks
from elastic.messages import Digest, NodeCommand
from elastic.priority import control_priority

logger = logging.getLogger(__name__)

GROUPS = {"digest": 2, "command": 1, "bell": 1}


def _loop(pump, timeout_s: float, name: str) -> None:
    while True:
        try:
            pump(timeout_s)
        except AgentGone:  # a virtual node that was lost: its agent dies with it
            os._exit(1)
        except Exception:  # noqa: BLE001 - keep watching; the error is in the actor's log
            logger.exception("%s: loop error", name)
            time.sleep(0.1)


# The ignore: Ray's stubs for ray.remote(**options) list task options only, not the actor
# option concurrency_groups (which Ray takes: the bell, digest and command groups).
@ray.remote(num_cpus=0, max_restarts=0, concurrency_groups=GROUPS)  # type: ignore[call-overload]
class NodeAgent:
    """The agent of one node: its ranks' liveness, polls and reports, and the commands to them.

    ``virtual`` (the control-plane benchmark): a factory of virtual ranks instead of Ray
    calls to real ones."""

    def __init__(self, node: str, poll_wait_s: float = POLL_WAIT_S, virtual: Any = None):
        control_priority()  # above busy ranks where allowed, else at 0: at Ray's niceness (15) news would wait
        self._doorbell = Doorbell(ray.get_runtime_context().current_actor)
        backend = ActorRanks(self._doorbell) if virtual is None else virtual.backend(node, self._doorbell)
        self.core = NodeCore(node, backend, poll_wait_s=poll_wait_s)
        self._order = InOrder()
        threading.Thread(target=_loop, args=(self.core.pump, poll_wait_s, f"agent {node[:8]}"), daemon=True).start()

    @ray.method(concurrency_group="bell", enable_task_events=False)
    def bell(self) -> bool:
        return self._doorbell.answer()

    @ray.method(concurrency_group="digest", enable_task_events=False)
    def digest(self, acks: dict[str, int] | None, wait_s: float, resend: bool = False, linger_s: float = 0.0) -> Digest:
        return self.core.digest(acks, wait_s, resend, linger_s)

    @ray.method(concurrency_group="command")
    def command(self, sender: str, seq: int, cid: int, parts: dict[str, NodeCommand]) -> None:
        self._order.run(sender, seq, self._command, cid, parts)

    def _command(self, cid: int, parts: dict[str, NodeCommand]) -> None:
        for part in parts.values():
            self.core.command(cid, part)

    @ray.method(concurrency_group="command")
    def where(self) -> tuple[str, int]:
        """(node id, pid): for the driver's checks and the tests' faults."""
        return ray.get_runtime_context().get_node_id(), os.getpid()

    @ray.method(concurrency_group="command")
    def lifeline(self, address: tuple[str, int], ticket: str) -> None:
        """Hold a lifeline to the parent at ``address`` (``lifeline.py``); a new parent's replaces it."""
        _relink(self, address, ticket)


# The ignore: Ray's stubs for ray.remote(**options) list task options only, not the actor
# option concurrency_groups (which Ray takes: the bell, digest and command groups).
@ray.remote(num_cpus=0, max_restarts=0, concurrency_groups=GROUPS)  # type: ignore[call-overload]
class Aggregator:
    """Merges the digests of a bounded number of children into one per answer."""

    def __init__(self, child_wait_s: float = CHILD_WAIT_S):
        control_priority()  # (as the node agent's)
        self._doorbell = Doorbell(ray.get_runtime_context().current_actor)
        self.core = AggregatorCore(self._doorbell, child_wait_s=child_wait_s)
        self._lifelines = LifelineServer(ray.util.get_node_ip_address(), on_close=self.core.child_gone)
        self._local: dict[str, Any] = {}  # what local children (virtual nodes) share in this process
        self._order = InOrder()
        threading.Thread(target=_loop, args=(self.core.pump, child_wait_s, "aggregator"), daemon=True).start()

    @ray.method(concurrency_group="bell", enable_task_events=False)
    def bell(self) -> bool:
        return self._doorbell.answer()

    @ray.method(concurrency_group="digest", enable_task_events=False)
    def digest(self, acks: dict[str, int] | None, wait_s: float, resend: bool = False, linger_s: float = 0.0) -> Digest:
        return self.core.digest(acks, wait_s, resend, linger_s)

    # Commands and changes of shape, each applied in the order its sender sent it (``ordered.py``).
    @ray.method(concurrency_group="command")
    def command(self, sender: str, seq: int, cid: int, parts: dict[str, NodeCommand]) -> None:
        self._order.run(sender, seq, self.core.command, cid, parts)

    @ray.method(concurrency_group="command")
    def adopt(self, sender: str, seq: int, key: str, handle: Any, nodes: list[str]) -> None:
        """Add or replace the child ``key`` (an actor, or a local node's factory), over ``nodes``."""
        self._order.run(sender, seq, self._adopt, key, handle, nodes)

    def _adopt(self, key: str, handle: Any, nodes: list[str]) -> None:
        local = not isinstance(handle, ray.actor.ActorHandle)
        ticket = None if local else self._lifelines.ticket(key)  # first: the old child's end is no news now
        self.core.adopt(key, handle.start(self._local) if local else handle, nodes, local=local)
        if ticket is not None:
            handle.lifeline.remote(self._lifelines.address, ticket)

    @ray.method(concurrency_group="command")
    def route(self, sender: str, seq: int, key: str, nodes: list[str]) -> None:
        self._order.run(sender, seq, self.core.route, key, nodes)

    @ray.method(concurrency_group="command")
    def disown(self, sender: str, seq: int, nodes: list[str]) -> None:
        self._order.run(sender, seq, self._disown, nodes)

    def _disown(self, nodes: list[str]) -> None:
        for key in self.core.disown(nodes):
            self._lifelines.forget(key)

    @ray.method(concurrency_group="command")
    def where(self) -> tuple[str, int]:
        return ray.get_runtime_context().get_node_id(), os.getpid()

    @ray.method(concurrency_group="command")
    def lifeline(self, address: tuple[str, int], ticket: str) -> None:
        _relink(self, address, ticket)


def _relink(actor: Any, address: tuple[str, int], ticket: str) -> None:
    """Hold ``actor``'s lifeline to a parent (``lifeline.py``), closing the one it had; a
    parent that cannot be reached now leaves the actor without one (its long poll still
    judges it)."""
    old = getattr(actor, "_lifeline", None)
    try:
        actor._lifeline = hold(address, ticket)
    except OSError as exc:
        logger.warning("no lifeline to %s: %s", address, exc)
        actor._lifeline = None
    if old is not None:
        old.close()


# What @ray.remote made of the two classes, for the driver's ``.options(...).remote(...)``:
# mypy keeps a decorated class's own type (it does not apply a class decorator's result).
NodeAgentActor = cast("ActorClass[NodeAgent]", NodeAgent)
AggregatorActor = cast("ActorClass[Aggregator]", Aggregator)
