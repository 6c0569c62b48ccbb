"""Leaving a gloo group by cutting its sockets frees a peer blocked on this rank at once.

Control: without the cut (and with the group still referenced, as C++ state can keep it
after a failure), the peer waits for the whole collective timeout.
"""

from __future__ import annotations

import pytest
from parallel_harness import run_ranks
from socket_workers import blocked_peer_after_leave, cut_links_to_a_silent_peer, stuck_survivor_cuts_its_own_links
from waiting import wait_until

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


def test_a_descriptor_number_reused_by_another_socket_is_left_alone(monkeypatch):
    """A captured socket closed, and its number taken by a new connection (gloo and Ray open
    and close sockets on other threads), even while the cut runs: the cut shuts down only
    the sockets it captured."""
    import os
    import socket

    from elastic.parallel import sockets
    from elastic.parallel.sockets import GroupSockets

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    group = GroupSockets()
    group.before_init()
    captured = socket.create_connection(("127.0.0.1", port))
    kept = socket.create_connection(("127.0.0.1", port))
    group.capture()
    number = captured.fileno()
    assert number in group.sockets and kept.fileno() in group.sockets
    other = socket.create_connection(("127.0.0.1", port))
    real_dup = os.dup

    def dup_after_a_reuse(fd):  # another thread closes the socket and reuses its number now
        if fd == number and captured.fileno() != -1:
            captured.detach()
            os.dup2(other.fileno(), number)  # closes the captured socket, the number is other's
        return real_dup(fd)

    monkeypatch.setattr(sockets.os, "dup", dup_after_a_reuse)
    try:
        assert group.cut() == 1  # ``kept`` only
        reused = socket.socket(fileno=real_dup(number))
        reused.sendall(b"x")  # the connection that took the number is still open
        reused.close()
        with pytest.raises(OSError):
            kept.sendall(b"x" * (1 << 20))
    finally:
        for s in (other, kept, listener):
            s.close()
        os.close(number)


def test_cutting_the_links_to_a_lost_rank_frees_a_blocked_peer_and_leaves_live_links_up(tmp_path):
    """The driver's abort carries the lost rank's connections; a survivor shuts its ends of
    them down: its collective with the lost rank fails at once although that process still
    holds its sockets open, and its group with a live peer still works. Without the cut the
    survivor waits out the collective timeout (the worker takes ``cut=False``: 11 of 12 such
    runs did, 2026-11-28; in the twelfth gloo aborted the survivor when the silent rank
    exited after the timeout, so that control is not part of the suite)."""
    timeout_s = TIMEOUT_S / 2
    results = run_ranks(3, cut_links_to_a_silent_peer, (timeout_s, True), tmp_path)
    survivor = results[2]
    assert survivor["error"], "the all-reduce cannot complete: rank 1 never joined it"
    assert survivor["live_sum"] == [3.0, 3.0] and results[0]["live_sum"] == [3.0, 3.0]
    assert survivor["cut"] >= 1
    assert survivor["blocked_s"] < timeout_s / 2, survivor


def test_a_cut_of_named_links_shuts_those_and_no_others():
    """``links_to`` turns a peer's connections into this side's; ``cut(links)`` shuts down
    only the captured streams named there, and keeps the rest captured."""
    import socket

    from elastic.messages import links_to
    from elastic.parallel.sockets import GroupSockets

    listener = socket.create_server(("127.0.0.1", 0))
    group = GroupSockets()
    group.before_init()
    a = socket.create_connection(listener.getsockname())
    b = socket.create_connection(listener.getsockname())
    group.capture()  # this side's ends only
    a_far, _ = listener.accept()
    b_far, _ = listener.accept()
    try:
        assert len(group.connections) == 2
        lost = [(*a_far.getsockname(), *a_far.getpeername())]  # the connections the lost peer reported
        assert group.cut(links_to(lost)) == 1
        assert a_far.recv(1) == b""  # the lost end sees the link closed
        b.sendall(b"y")
        assert b_far.recv(1) == b"y"  # the other link is up
        assert len(group.sockets) == 2  # still captured: a full cut later takes the rest
        # What a survivor logs when its cut finds nothing: a link shut on this side still has its
        # peer until the far end closes too; then it is unconnected; closed here, it is gone.
        assert group.census() == {"captured": 2, "connected": 2, "unconnected": 0, "other": 0}
        a_far.close()
        wait_until(lambda: group.census()["unconnected"] == 1, 5, "the far end's close to arrive", 0.01)
        a.close()
        assert group.census() == {"captured": 2, "connected": 1, "unconnected": 0, "other": 1}
        assert group.cut() >= 1 and group.sockets == {}
        assert b_far.recv(1) == b""
    finally:
        for s in (a, b, a_far, b_far, listener):
            s.close()


def test_a_survivor_still_in_its_step_after_the_abort_cuts_its_own_links(tmp_path):
    """The last resort of ``abort_step``: a survivor blocked on a peer whose sockets stay
    open, where the cut of the links to the lost rank did not reach, logs its stacks and cuts
    all of its own connections once it is still in its step ``after_s`` (0.3 s here, 5 s in a
    worker) after the abort: its collective fails then, not after the collective timeout."""
    results = run_ranks(2, stuck_survivor_cuts_its_own_links, (TIMEOUT_S,), tmp_path)
    survivor = results[0]
    assert survivor["connections"] >= 1
    assert survivor["error"], "the all-reduce cannot complete: rank 1 never joined it"
    assert survivor["blocked_s"] < TIMEOUT_S / 2, survivor
    assert survivor["stacks_name_the_collective"]
    assert survivor["left"] == 0  # freed by its cut: it stays in the job


def test_a_survivor_its_own_cut_does_not_free_leaves_the_job(tmp_path):
    """The cut of its own connections shuts nothing, and the survivor is still blocked in the
    all-reduce ``leave_after_s`` later: it leaves the job (``leave``; a worker exits), where
    the driver would otherwise wait out ``survivors_wait_s`` (3 steps) before killing it."""
    results = run_ranks(2, stuck_survivor_cuts_its_own_links, (TIMEOUT_S, False), tmp_path)
    survivor = results[0]
    assert survivor["left"] == 1 and survivor["error"], survivor
    assert survivor["blocked_s"] < TIMEOUT_S / 2, survivor
