"""The job's rendezvous store answers nobody without the job's secret (issues 25 and 48, security).

Real parts: the driver's ``RendezvousStore`` (a ``TCPStore`` server behind its gate), worker
processes joining a real gloo group through ``ReconfigurableProcessGroup`` and their local
relays, and an outsider that reaches the ports with its own ``TCPStore`` client, as anyone
on the network or the host could. The relay itself: ``tests/worker/test_store_relay.py``.
"""

from __future__ import annotations

import datetime
import socket

import pytest
import torch
import torch.distributed as dist

from elastic.testing.ranks import run_ranks
from elastic.worker.job_store import JobStore, StoreTampered
from elastic.worker.process_group import ReconfigurableProcessGroup, RendezvousStore

pytestmark = pytest.mark.timeout(120)


def _non_loopback_ip() -> str | None:
    """This machine's address on its default route, if it has one besides loopback."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.254", 9))  # no packet is sent: this only picks the route's source address
            ip = s.getsockname()[0]
        except OSError:
            return None
    return None if ip.startswith("127.") else ip


def test_sealed_values_round_trip_and_refuse_forgery():
    inner = dist.HashStore()
    job = JobStore(inner, "a" * 64)
    job.set("gen1/0", b"10.0.0.1:1234")
    assert job.get("gen1/0") == b"10.0.0.1:1234"
    assert not inner.check(["gen1/0"])  # the plain key name is not there
    raw = inner.get(job.name("gen1/0"))
    assert b"10.0.0.1" not in raw  # encrypted
    other = JobStore(inner, "b" * 64)
    assert other.name("gen1/0") != job.name("gen1/0")
    inner.set(job.name("gen1/0"), raw[:-1] + bytes([raw[-1] ^ 1]))  # one bit of the tag flipped
    with pytest.raises(StoreTampered):
        job.get("gen1/0")
    inner.set(job.name("gen1/0"), JobStore(dist.HashStore(), "b" * 64).seal(job.name("gen1/0"), b"forged"))
    with pytest.raises(StoreTampered):  # sealed with another secret
        job.get("gen1/0")
    assert job.add("counter", 2) == 2 and job.add("counter", 0) == 2
    assert job.ops == 6


def _join(rank: int, world: int, out_dir: str, address: tuple[str, int], secret: str) -> dict:
    group = ReconfigurableProcessGroup("cpu", 30)
    group.join(1, rank, world, address, secret)
    t = torch.ones(1)
    dist.all_reduce(t)
    ops = group.store_ops()
    dist.barrier()
    group.leave()
    return {"sum": float(t), "ops": ops}


def test_a_clone_made_from_cpp_is_sealed_and_counted_the_same():
    """c10d clones a group's store in C++ (``split_group``, NCCL's set-up): a ``PrefixStore``
    over the job's store, cloned as c10d does, reads and writes the same sealed keys and
    counts into the rank's tally. Without ``JobStore.clone`` this failed with "pure virtual
    function ::c10d::Store::clone" on the first NCCL split (seen on an H200)."""
    import gc

    server = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False, timeout=datetime.timedelta(seconds=10))
    job = JobStore(dist.TCPStore("127.0.0.1", server.port, 1, False, timeout=datetime.timedelta(seconds=10)), "b" * 64)
    twin = dist.PrefixStore("gen2", job).clone()
    gc.collect()  # the clone's Python side must outlive the call that made it
    twin.set("0", b"10.0.0.2:2345")
    assert job.get("gen2/0") == b"10.0.0.2:2345" and twin.get("0") == b"10.0.0.2:2345"
    assert job.ops == 3
    assert not server.check(["gen2/0"])  # sealed: the plain name is not on the server


@pytest.mark.cluster
def test_store_answers_nobody_without_the_jobs_secret(tmp_path):
    """Two worker processes form a real gloo group through their relays and the gate; an
    outsider's own ``TCPStore`` client on the gate's port, on the store's loopback port, or
    behind a relay with the wrong secret, reads, writes and deletes nothing: the job's keys
    are all there afterwards, with their values."""
    host = _non_loopback_ip() or "127.0.0.1"
    server = RendezvousStore(host, 30)
    try:
        results = run_ranks(2, _join, (server.address, server.secret), tmp_path)
        assert [r["sum"] for r in results] == [2.0, 2.0]
        assert all(r["ops"] > 0 for r in results)
        keys = server._store.list_keys()  # the store's own view (the driver's client)
        assert keys and all(k.startswith("j/") for k in keys)
        before = {k: server._store.get(k) for k in keys}
        server.take_denials()

        with pytest.raises(dist.DistNetworkError):  # dropped before its first request is answered
            dist.TCPStore(host, server.port, is_master=False, timeout=datetime.timedelta(seconds=1))
        with socket.socket() as s:  # loopback: the kernel drops an unsigned connection
            s.settimeout(1)
            with pytest.raises(OSError):
                s.connect(("127.0.0.1", server.loopback_port))
        assert server.signed_loopback
        if host != "127.0.0.1":  # the gate is bound to the workers' interface only
            with socket.socket() as s:
                s.settimeout(2)
                assert s.connect_ex(("127.0.0.1", server.port)) != 0

        assert {k: server._store.get(k) for k in server._store.list_keys()} == before
        denied = server.take_denials()
        assert denied is not None and denied["reasons"].keys() == {"no proof of the job's secret"}
    finally:
        server.close()


def test_gloo_groups_are_re_formed_not_shrunk():
    """gloo has no shrink (``supports_shrinking`` is false): the group says so instead of trying."""
    assert not ReconfigurableProcessGroup("cpu", 30).shrink((1,))


def test_a_cut_of_all_connections_that_finds_none_says_what_became_of_them(caplog):
    """A survivor stuck after the abort cuts every connection it captured (``cut_all``); when
    none is left to shut, the census of its captured sockets goes to its log, so that the next
    stall says where its connections went (2026-11-29: one such cut shut none)."""
    group = ReconfigurableProcessGroup("cpu", 30)
    with caplog.at_level("WARNING", logger="elastic.worker.process_group"):
        assert group.cut_all() == 0
    assert "'captured': 0, 'connected': 0" in caplog.text
