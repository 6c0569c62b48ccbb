"""Leaving a gloo group by cutting its sockets frees a peer blocked on this rank at once.

Control: without the cut (and with the group still referenced, as C++ state can keep it
after a failure), the peer waits for the whole collective timeout.
"""

from __future__ import annotations

import pytest
from parallel_harness import run_ranks
from parallel_workers import blocked_peer_after_leave

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(120)]

TIMEOUT_S = 10.0


@pytest.mark.parametrize("cut", [True, False], ids=["cut", "no-cut"])
def test_cutting_the_group_sockets_frees_a_blocked_peer(tmp_path, cut):
    results = run_ranks(3, blocked_peer_after_leave, (cut, TIMEOUT_S), tmp_path)
    blocked = results[2]
    assert blocked["error"], "the all-reduce cannot complete: rank 1 never joined it"
    if cut:
        assert results[1]["cut"] >= 1
        # Rank 1 leaves as soon as the peer enters the all-reduce: it fails then, long before
        # the timeout (bound at half of it, loose for a loaded machine).
        assert blocked["blocked_s"] < TIMEOUT_S / 2, blocked
        assert "Connection closed" in blocked["error"] or "Connection reset" in blocked["error"], blocked
    else:
        assert blocked["blocked_s"] >= TIMEOUT_S * 0.9, blocked
