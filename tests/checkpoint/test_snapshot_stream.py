"""``elastic/checkpoint/snapshot_stream.py``: a held snapshot sent to one peer over TCP,
bit for bit, only to the peer that holds the offer's token, with every wait bounded."""

from __future__ import annotations

import socket
import threading

import pytest
import torch
from waiting import wait_until

from elastic.checkpoint.snapshot import Snapshot
from elastic.checkpoint.snapshot_stream import TOKEN_BYTES, offer, receive, receive_all
from storage.records import ShardRecord

pytestmark = pytest.mark.timeout(60)


def _snapshot(seed: int = 0, rows: int = 300) -> Snapshot:
    g = torch.Generator().manual_seed(seed)
    tensors = {
        "app/model/w": torch.randn(rows, 700, generator=g),  # 0.84 MB: several chunks' worth of calls
        "app/model/half": torch.randn(5, 3, generator=g).to(torch.bfloat16),
        "app/optim/step": torch.tensor(7, dtype=torch.int64),
        "app/mask": torch.rand(4, generator=g) > 0.5,
        "app/empty": torch.empty(0, 3),
        "app/model/shard": ShardRecord(torch.randn(2, 4, generator=g), (6, 4), (2, 0)),
        "app/model/strided": torch.randn(6, 5, generator=g).t(),  # not contiguous where held
    }
    objects = {"step": 7, "data": {"cursor": [1, 2]}, "rng": b"\x00\x01"}
    return Snapshot(7, 3, tensors, objects, {"dp": 2, "tp": 1, "pp": 1}, complete=True)


def _local(v):
    return v.local if isinstance(v, ShardRecord) else v


def _assert_same(got: Snapshot, want: Snapshot) -> None:
    assert (got.step, got.rank, got.layout, got.objects) == (want.step, want.rank, want.layout, want.objects)
    assert list(got.tensors) == list(want.tensors)
    for key, value in want.tensors.items():
        mine = got.tensors[key]
        assert isinstance(mine, ShardRecord) == isinstance(value, ShardRecord), key
        if isinstance(value, ShardRecord):
            assert (mine.global_shape, mine.offsets) == (value.global_shape, value.offsets), key
        assert _local(mine).dtype == _local(value).dtype and torch.equal(_local(mine), _local(value)), key
    assert got.complete


def test_a_snapshot_arrives_bit_for_bit_and_the_holder_is_told_once():
    snap, closed = _snapshot(), []
    offered = offer(snap, "127.0.0.1", timeout_s=10, done=lambda: closed.append(1))
    assert offered["address"][0] == "127.0.0.1" and len(offered["token"]) == TOKEN_BYTES
    _assert_same(receive(offered, timeout_s=10), snap)
    wait_until(lambda: closed == [1], 5, "the holder told its send is over", 0.01)
    with pytest.raises(OSError):  # one connection per offer: the listener is closed
        receive(offered, timeout_s=2)


def test_a_peer_without_the_token_gets_nothing():
    done = threading.Event()
    offered = offer(_snapshot(), "127.0.0.1", timeout_s=10, done=done.set)
    with socket.create_connection(tuple(offered["address"]), timeout=5) as conn:
        conn.sendall(b"x" * TOKEN_BYTES)
        assert conn.recv(1) == b""  # closed without a byte of the snapshot
    assert done.wait(5)


def test_an_offer_nobody_takes_is_closed_after_its_timeout():
    done = threading.Event()
    offered = offer(_snapshot(), "127.0.0.1", timeout_s=0.5, done=done.set)
    assert done.wait(5)
    with pytest.raises(OSError):
        receive(offered, timeout_s=2)


def test_a_holder_that_stops_mid_stream_fails_the_receive_saying_so():
    """The receiver expects more than the holder sends (as when the holder dies mid-way)."""
    offered = offer(_snapshot(rows=10), "127.0.0.1", timeout_s=10)
    offered["boxes"] = {k: {**b, "shape": (400, 700)} if k == "app/model/w" else b for k, b in offered["boxes"].items()}
    with pytest.raises(ConnectionError, match="closed the connection after"):
        receive(offered, timeout_s=10)


def test_several_holders_at_once():
    snaps = {0: _snapshot(0), 5: _snapshot(5)}
    offers = {owner: offer(s, "127.0.0.1", timeout_s=10) for owner, s in snaps.items()}
    got = receive_all(offers, timeout_s=10)
    assert sorted(got) == [0, 5]
    for owner, snap in snaps.items():
        _assert_same(got[owner], snap)
