"""Lifelines (elastic/agent/lifeline.py): a child process's end is seen by its parent from
the kernel closing the socket, within milliseconds, with real processes killed by SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from elastic.agent.lifeline import LifelineServer

CHILD = """
import sys, time
from elastic.agent.lifeline import hold
sock = hold((sys.argv[1], int(sys.argv[2])), sys.argv[3])
print("held", flush=True)
time.sleep(600)
"""


def _child(server: LifelineServer, ticket: str) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, server.address[0], str(server.address[1]), ticket],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def _kill(proc: subprocess.Popen) -> float:
    at = time.monotonic()
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    return at


def _wait(cond, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


@pytest.fixture
def server():
    ended: list[str] = []
    rang = threading.Event()

    def on_close(key: str) -> None:
        ended.append(key)
        rang.set()

    s = LifelineServer("127.0.0.1", on_close=on_close)
    s.ended, s.rang = ended, rang  # type: ignore[attr-defined]
    yield s
    s.close()


def test_a_killed_child_is_seen_at_once(server):
    proc = _child(server, server.ticket("node-a"))
    try:
        assert server.closed() == {}  # alive: nothing to report
        killed_at = _kill(proc)
        assert server.rang.wait(timeout=5.0)
        ended = server.closed()
        assert list(ended) == ["node-a"] and server.ended == ["node-a"]
        assert killed_at <= ended["node-a"] < killed_at + 1.0
        assert server.closed() == {}  # reported once
    finally:
        proc.kill()


def test_a_replaced_childs_old_lifeline_is_no_news(server):
    old = _child(server, server.ticket("node-a"))
    assert _wait(lambda: server.held == 1)
    new = _child(server, server.ticket("node-a"))  # the child was replaced: a new ticket
    try:
        assert _wait(lambda: server.held == 2)
        dropped = server.dropped
        _kill(old)
        assert _wait(lambda: server.dropped > dropped)  # its end was taken in ...
        assert server.closed() == {} and server.ended == []  # ... and is not the new one's
        _kill(new)
        assert server.rang.wait(timeout=5.0)
        assert list(server.closed()) == ["node-a"]
    finally:
        old.kill()
        new.kill()


def test_a_stranger_or_a_forgotten_child_is_no_news(server):
    stranger = _child(server, "not-a-ticket-of-this-server")
    gone = _child(server, server.ticket("node-b"))
    try:
        assert _wait(lambda: server.dropped >= 1 and server.held == 1)  # the stranger's connection is refused
        server.forget("node-b")  # its node left for good
        dropped = server.dropped
        _kill(gone)
        _kill(stranger)
        assert _wait(lambda: server.dropped > dropped)
        assert server.closed() == {} and server.ended == []
    finally:
        stranger.kill()
        gone.kill()
