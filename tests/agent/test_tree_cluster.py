"""The driver's agent tree on a real Ray: an agent that cannot be placed because its node left
(a replacement started just before the node was removed) is a lost agent, not a crash."""

from __future__ import annotations

import math
import time

import pytest

from elastic.control.agent_link import AgentTree

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(120)]


def test_an_agent_whose_node_left_is_lost_not_a_crash(ray_local):
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from elastic.agent.actors import NodeAgent

    gone = "ab" * 28  # a node id that no longer exists (Ray's are 28 bytes)

    def make_agent(node: str):
        return NodeAgent.options(scheduling_strategy=NodeAffinitySchedulingStrategy(gone, soft=False)).remote(node)

    tree = AgentTree(make_agent, make_aggregator=lambda: None, fan_in=32)
    tree.add_nodes([gone], expected_nodes=1)
    lost: dict[str, float] = {}
    deadline = time.monotonic() + 60
    while not lost and time.monotonic() < deadline:
        lost = tree.look(0.5).lost  # raised ActorUnschedulableError before
    assert lost == {gone: math.inf}
    tree.shutdown()
