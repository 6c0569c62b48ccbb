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
    """Receives snapshots like ``TrainWorker.store_replica``.

    ``gate`` holds each delivery until it is set (a slow or busy peer, under the test's
    control, with no sleeps); ``entered`` is set once a delivery is waiting on the gate.
    """

    def __init__(self, gate: threading.Event | None = None):
        self.tier = MemoryTier()
        self.gate = gate
        self.entered = threading.Event()
        self.arrived: list[int] = []

    def send(self, snap):
        payload = pickle.dumps(snap)  # serialised before send() returns, as Ray's .remote() does

        def delivered():
            self.entered.set()
            if self.gate is not None:
                assert self.gate.wait(30), "the test never opened the gate"
            got = pickle.loads(payload)
            assert self.tier.store_replica(got)
            self.arrived.append(got.step)

        return delivered


def test_every_snapshot_reaches_the_peer_intact_despite_buffer_reuse():
    own, peer = MemoryTier(), Peer()
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
    gate = threading.Event()
    own, peer = MemoryTier(), Peer(gate)
    own.replicate_to(peer.send)
    own.snapshot_async(1, 0, _state(1.0, 1), LAYOUT)  # returns although the peer holds step 1
    own.wait()  # the copy is done; the replication is still in flight
    assert peer.entered.wait(30), "the replication of step 1 never started"
    assert own.steps() == [1] and peer.arrived == []
    second: dict = {}

    def snapshot_two():
        second["blocked_s"] = own.snapshot_async(2, 0, _state(2.0, 2), LAYOUT)
        second["arrived"] = list(peer.arrived)

    thread = threading.Thread(target=snapshot_two, daemon=True)
    thread.start()
    thread.join(0.2)  # one-sided: a snapshot that did not wait would have finished by now
    assert thread.is_alive() and "blocked_s" not in second, "the second snapshot did not wait for the peer"
    gate.set()
    thread.join(30)
    assert not thread.is_alive()
    # The second snapshot started only once the first had landed, and was held while it had not.
    # (step 2's own copy may land too before the list is read, on a loaded machine: only
    # step 1 having arrived first is the point)
    assert second["arrived"][:1] == [1] and second["blocked_s"] >= 0.2


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
        return lambda: release.wait(60)  # hangs until the test ends

    own.replicate_to(send, timeout_s=0.2)
    own.snapshot_async(1, 0, _state(1.0, 1), LAYOUT)
    own.wait()
    t0 = time.perf_counter()
    own.snapshot_async(2, 0, _state(2.0, 2), LAYOUT)
    # Not held for the hang (60 s): abandoned after the 0.2 s timeout (bound loose for a loaded machine).
    assert time.perf_counter() - t0 < 30 and own.replication_errors == 1
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


def test_a_copy_in_flight_counts_as_held_and_gives_way_to_a_recovery(monkeypatch):
    """A recovery does not wait for the copy of the step it resumes from: the copy in flight
    is in the holdings, its plain values are there at once, ``get`` waits for its tensors,
    and after a peer's loss its thread runs at the background niceness."""
    import os

    from elastic.priority import BACKGROUND_NICE

    entered, gate = threading.Event(), threading.Event()
    real_copy = torch._foreach_copy_
    seen: dict = {}

    def held_copy(dsts, srcs, **kw):  # the real copy, once the test lets it go
        seen["tid"] = threading.get_native_id()
        entered.set()
        assert gate.wait(30), "the test never opened the gate"
        seen["nice"] = os.getpriority(os.PRIO_PROCESS, seen["tid"])
        return real_copy(dsts, srcs, **kw)

    own = MemoryTier()
    own.snapshot_async(3, 0, _state(3.0, 3), LAYOUT)
    own.wait()
    monkeypatch.setattr(torch, "_foreach_copy_", held_copy)
    own.snapshot_async(4, 0, _state(4.0, 4), LAYOUT)
    assert entered.wait(30), "the copy of step 4 never started"
    assert own.steps() == [3]  # complete ones only
    assert own.holdings() == {0: [3, 4]}  # the one in flight counts
    assert own.progress(0, 4)["train/step"] == 4  # without waiting for the copy
    before = os.getpriority(os.PRIO_PROCESS, seen["tid"])
    own.yield_copy()
    got: dict = {}
    reader = threading.Thread(target=lambda: got.update(snap=own.get(0, 4)), daemon=True)
    reader.start()
    reader.join(0.2)  # one-sided: a get that did not wait would have returned by now
    assert reader.is_alive() and not got, "get returned a snapshot whose copy was not done"
    gate.set()
    reader.join(30)
    assert torch.equal(got["snap"].tensors["app/w"], torch.full((64, 64), 4.0))
    assert seen["nice"] == max(before, BACKGROUND_NICE)
    own.wait()
    assert own.steps() == [3, 4]


def test_a_new_layout_forgets_the_old_snapshots_and_reuses_their_buffers():
    tier = MemoryTier()
    for step in (1, 2):
        tier.snapshot_async(step, 0, _state(float(step), step), LAYOUT)
        tier.wait()
    old = {id(tier.get(0, s).tensors["app/w"].untyped_storage()): s for s in (1, 2)}
    leased = tier.get(0, 2, lease=True)  # e.g. a peer still fetching it: kept, not reused
    new = {**LAYOUT, "dp": 1}
    tier.keep_layout(new)
    assert tier.holdings() == {} and not tier.holds_own(2, 0, new) and tier.holds_own(2, 0, LAYOUT)
    tier.snapshot_async(2, 0, _state(2.0, 2), new)  # the step a new layout resumes from
    tier.wait()
    assert tier.holds_own(2, 0, new)
    snap = tier.get(0, 2)
    assert snap.layout == new and torch.equal(snap.tensors["app/w"], torch.full((64, 64), 2.0))
    assert old.get(id(snap.tensors["app/w"].untyped_storage())) == 1  # step 1's buffer, not a new one
    assert torch.equal(leased.tensors["app/w"], torch.full((64, 64), 2.0))


def test_a_survivor_relabels_its_snapshot_for_the_new_layout_without_a_copy():
    peer = Peer()
    tier = MemoryTier()
    tier.snapshot_async(5, 2, _state(5.0, 5), LAYOUT)  # taken as rank 2 of the old layout
    tier.wait()
    storage = tier.get(2, 5).tensors["app/w"].untyped_storage()
    new = {**LAYOUT, "dp": 1}
    tier.replicate_to(peer.send)
    assert not tier.relabel(5, 0, 1, new)  # not a snapshot taken as rank 0
    assert tier.relabel(5, 2, 1, new)  # rank 2 is rank 1 now, with the same state
    tier.keep_layout(new)
    tier.wait_replication()
    assert tier.holdings() == {1: [5]} and tier.holds_own(5, 1, new)
    snap = tier.get(1, 5)
    assert snap.tensors["app/w"].untyped_storage().data_ptr() == storage.data_ptr()  # no copy
    assert peer.arrived == [5] and peer.tier.get(1, 5).layout == new  # the new layout's peer has it
