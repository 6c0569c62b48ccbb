"""The cancellable rendezvous: it forms like a plain one, and gives up at once when abandoned."""

from __future__ import annotations

import socket

import pytest

from parallel_harness import run_ranks
from parallel_workers import cancellable_rendezvous

pytestmark = pytest.mark.timeout(120)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def test_forms_a_group_with_sub_groups(tmp_path):
    results = run_ranks(3, cancellable_rendezvous, (_port(), False), tmp_path)
    assert [r.get("value") for r in results] == [6.0, 6.0, 3.0], results  # world sum, then the {0, 1} sum


def test_abandoned_rendezvous_fails_at_once_not_at_its_timeout(tmp_path):
    results = run_ranks(3, cancellable_rendezvous, (_port(), True), tmp_path)
    for r in results[:2]:
        assert r.get("error") == "RendezvousCancelled", results
        assert r["seconds"] < 10, results  # abandoned at 1.5 s; the timeout is 30 s
