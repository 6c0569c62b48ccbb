"""Failure diagnosis from the first signal (elastic/control/diagnosis.py), with real sockets as raylets.

A "raylet" here is a real listening TCP socket (alive) or a port nobody listens on any more
(a lost node: the connection is refused). No Ray cluster is needed: what the diagnosis
reads is the members' poll and run() records, on the driver's clock.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

import pytest

from elastic.control.config import ElasticConfig
from elastic.control.diagnosis import PEER_GRACE_S, RayletProbe, diagnose
from elastic.errors import NodeLost
from elastic.messages import RunOutcome

pytestmark = pytest.mark.timeout(30)

NOW = 1000.0


@dataclass
class FakeMember:
    rank: int
    node_id: str
    last_ok: float = NOW
    run_result: RunOutcome | None = None
    returned_at: float = 0.0
    dead: bool = False


@pytest.fixture
def raylets():
    """Node "live" has a listening raylet; node "lost" had one, now closed (refused)."""
    live = socket.create_server(("127.0.0.1", 0))
    gone = socket.create_server(("127.0.0.1", 0))
    gone_addr = gone.getsockname()
    gone.close()
    probe = RayletProbe()
    probe.update({"live": live.getsockname(), "lost": gone_addr})
    yield probe
    live.close()


def _peer_error(rank: int, node: str, at: float) -> FakeMember:
    return FakeMember(rank, node, run_result=RunOutcome("error", 12, "peer", "Connection closed"), returned_at=at)


def test_a_lost_node_is_diagnosed_at_the_first_peer_error(raylets):
    """No grace period: the lost node's raylet refuses at once, so its ranks are dead now."""
    members = [_peer_error(0, "live", NOW), FakeMember(1, "lost", last_ok=NOW - 0.05), FakeMember(2, "live")]
    failure = diagnose(members, ElasticConfig(), NOW + 0.001, raylets)
    assert isinstance(failure, NodeLost)
    assert failure.ranks == [1] and failure.nodes == ["lost"]


def test_a_live_rank_still_computing_is_not_blamed(raylets):
    """A peer error while a rank on a live node is still inside run(): not a failure yet."""
    members = [_peer_error(0, "live", NOW), FakeMember(1, "live", last_ok=NOW)]
    assert diagnose(members, ElasticConfig(), NOW + 0.001, raylets) is None
    # ... and not after the grace period either while it keeps answering polls.
    assert diagnose(members, ElasticConfig(), NOW + PEER_GRACE_S + 0.01, raylets) is None


def test_eager_probes_count_only_refusals():
    """A raylet that times out is not dead on the eager path, however often it is asked;
    on the silence path, ``TIMEOUTS_TO_DEATH`` timeouts in a row are."""
    # A listener with a full backlog that never accepts: connections neither succeed nor
    # are refused, they time out (as a raylet on a machine too loaded to accept).
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(0)
    held = [socket.create_connection(server.getsockname(), timeout=1.0)]  # fills the backlog
    try:
        probe = RayletProbe()
        probe.CONNECT_TIMEOUT_S = 0.05
        probe.update({"slow": server.getsockname()})
        for _ in range(RayletProbe.TIMEOUTS_TO_DEATH + 1):
            assert probe.dead({"slow"}, wait_s=0.0, refused_only=True) == set()
        dead = [probe.dead({"slow"}, wait_s=0.0) for _ in range(RayletProbe.TIMEOUTS_TO_DEATH)]
        assert dead == [set()] * (RayletProbe.TIMEOUTS_TO_DEATH - 1) + [{"slow"}]
    finally:
        for c in held:
            c.close()
        server.close()
