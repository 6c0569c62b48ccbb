"""The memory tier on its own: double buffering and peer replication, in one process.

The "peer" is a second ``MemoryTier``; the sender pickles the snapshot as Ray does when
it ships an actor call's arguments, so buffer reuse after sending is exercised for real.
"""

from __future__ import annotations

import pickle
import threading
import time

import pytest
import torch

from elastic.checkpoint.memory_tier import MemoryTier

pytestmark = pytest.mark.timeout(60)

LAYOUT = {"dp": 2, "tp": 1, "pp": 1, "zero": 3}


def _state(value: float, step: int) -> dict:
    return {"app": {"w": torch.full((64, 64), value), "b": torch.full((8,), value)}, "train": {"step": step}}


class Peer:
    """Receives snapshots like ``TrainWorker.store_replica``, after an optional delay."""

    def __init__(self, delay_s: float = 0.0):
        self.tier = MemoryTier()
        self.delay_s = delay_s
        self.arrived: list[int] = []

    def send(self, snap):
        payload = pickle.dumps(snap)  # serialised before send() returns, as Ray's .remote() does

        def delivered():
            time.sleep(self.delay_s)
            got = pickle.loads(payload)
            assert self.tier.store_replica(got)
            self.arrived.append(got.step)

        return delivered


def test_every_snapshot_reaches_the_peer_intact_despite_buffer_reuse():
    own, peer = MemoryTier(), Peer(delay_s=0.02)
    own.replicate_to(peer.send)
    for step in range(1, 7):
        own.snapshot_async(step, 1, _state(float(step), step), LAYOUT)
    own.wait()
    own.wait_replication()
    assert peer.arrived == [1, 2, 3, 4, 5, 6]  # backpressure: none skipped, in order
    assert peer.tier.holdings() == {1: [5, 6]}  # the two newest per owner
    for step in (5, 6):
        snap = peer.tier.get(1, step)
        assert torch.equal(snap.tensors["app/w"], torch.full((64, 64), float(step)))
        assert snap.objects["train/step"] == step
    assert [s for s, _, _ in own.replicated][-2:] == [5, 6] and own.replication_errors == 0


def test_a_slow_peer_delays_the_next_snapshot_not_the_current_one():
    own, peer = MemoryTier(), Peer(delay_s=0.3)
    own.replicate_to(peer.send)
    blocked_first = own.snapshot_async(1, 0, _state(1.0, 1), LAYOUT)
    own.wait()  # the copy is done; the replication is still in flight
    assert own.steps() == [1] and peer.arrived == []
    blocked_second = own.snapshot_async(2, 0, _state(2.0, 2), LAYOUT)
    assert peer.arrived == [1]  # the second snapshot started only once the first had landed
    assert blocked_second > blocked_first and blocked_second >= 0.2


def test_a_dead_peer_is_counted_not_raised():
    own = MemoryTier()

    def send(snap):
        raise ConnectionError("peer gone")

    own.replicate_to(send)
    own.snapshot_async(1, 0, _state(1.0, 1), LAYOUT)
    own.wait()
    own.wait_replication()
    assert own.replication_errors == 1 and own.steps() == [1]
    own.snapshot_async(2, 0, _state(2.0, 2), LAYOUT)  # training goes on
    own.wait()
    assert own.steps() == [1, 2]


def test_a_hung_peer_is_abandoned_after_the_timeout():
    own, release = MemoryTier(), threading.Event()

    def send(snap):
        return lambda: release.wait(10)

    own.replicate_to(send, timeout_s=0.2)
    own.snapshot_async(1, 0, _state(1.0, 1), LAYOUT)
    own.wait()
    t0 = time.perf_counter()
    own.snapshot_async(2, 0, _state(2.0, 2), LAYOUT)
    assert time.perf_counter() - t0 < 5 and own.replication_errors == 1
    release.set()
    own.wait()


def test_replicas_of_another_layout_are_refused_and_forgotten():
    sender, holder = MemoryTier(), MemoryTier()
    sender.snapshot_async(4, 1, _state(4.0, 4), LAYOUT)
    sender.wait()
    old = sender.get(1, 4)
    assert holder.store_replica(old) and holder.holdings() == {1: [4]}
    holder.keep_layout({**LAYOUT, "dp": 1})  # a resize settled: rank numbers mean other shards now
    assert holder.holdings() == {}
    assert not holder.store_replica(old)  # a late arrival from before the resize
    with pytest.raises(KeyError):
        holder.get(1, 4)


def test_a_leased_buffer_is_never_overwritten():
    tier = MemoryTier()
    tier.snapshot_async(1, 0, _state(1.0, 1), LAYOUT)
    tier.wait()
    leased = tier.get(0, 1, lease=True)  # e.g. the storage tier uploading it
    for step in range(2, 6):
        tier.snapshot_async(step, 0, _state(float(step), step), LAYOUT)
        tier.wait()
    assert torch.equal(leased.tensors["app/w"], torch.full((64, 64), 1.0))
    tier.release(leased)
    assert tier.steps() == [4, 5]
