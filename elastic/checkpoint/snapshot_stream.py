"""A held snapshot sent straight from the process that holds it to the rank that restores
from it, over one TCP connection (worker side).

A new rank (a replacement, a grow-back) or a resharding one restores from a peer's memory
snapshot. Through Ray's object store, the holder copied the snapshot into its node's
store, Ray moved it in chunks between the two nodes' stores, and the restoring rank read it
from its own: on this 2-core host a 1.2 GB snapshot took 11–13 s to arrive (about 100 MB/s,
under load), while the whole job waited. Here the holder's RPC (``offer``) answers with the
snapshot's description (its tensors' boxes, its plain values) and the address of a
one-connection listener; the restoring rank connects, proves it was told the offer's
random token, and receives each tensor's bytes straight into a tensor of its own
(``receive``): no copy into or out of an object store, and memory for one copy only.

Every wait is bounded (``timeout_s``): the listener accepts one connection, from a peer
that sends the offer's token within it, and is closed either way; a holder whose snapshot
is one of its own keeps it leased (not reused for a newer step) until the send is over.
"""

from __future__ import annotations

import hmac
import secrets
import socket
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from elastic.checkpoint.peer_fetch import layout_of
from elastic.checkpoint.snapshot import Snapshot
from storage.records import ShardRecord

TOKEN_BYTES = 16
CHUNK = 8 << 20  # bytes per send/receive call: large, so that a call's overhead is nothing


def _flat_bytes(t: torch.Tensor) -> memoryview:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data


def offer(snap: Snapshot, host: str, timeout_s: float, done: Callable[[], None] | None = None) -> dict[str, Any]:
    """Offer ``snap`` to one peer: its description, the listener's address and token.
    ``done`` is called once the listener is closed (sent, refused or timed out)."""
    listener = socket.create_server((host, 0))
    listener.settimeout(timeout_s)
    token = secrets.token_bytes(TOKEN_BYTES)
    order = [v.local if isinstance(v, ShardRecord) else v for v in snap.tensors.values()]  # as ``boxes``
    thread = threading.Thread(target=_serve, args=(listener, token, order, timeout_s, done), daemon=True)
    thread.start()
    return {
        "step": snap.step, "rank": snap.rank, "layout": dict(snap.layout), "objects": snap.objects,
        "boxes": layout_of(snap), "address": listener.getsockname()[:2], "token": token,
    }  # fmt: skip


def _serve(listener: socket.socket, token: bytes, order: list, timeout_s: float, done: Callable[[], None] | None):
    try:
        with listener:
            conn, _ = listener.accept()
        with conn:
            conn.settimeout(timeout_s)
            said = _recv_exact(conn, TOKEN_BYTES)
            if not hmac.compare_digest(said, token):
                return  # not the peer this offer was made to: nothing is sent
            for t in order:
                view = _flat_bytes(t)
                for i in range(0, len(view), CHUNK):
                    conn.sendall(view[i : i + CHUNK])
    except OSError:  # the peer left or never came: its restore fails and says so
        pass
    finally:
        if done is not None:
            done()


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    _recv_into(conn, memoryview(buf))
    return bytes(buf)


def _recv_into(conn: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = conn.recv_into(view[got : got + CHUNK])
        if n == 0:
            raise ConnectionError(f"the snapshot's holder closed the connection after {got} of {len(view)} bytes")
        got += n


def receive(offered: dict[str, Any], timeout_s: float) -> Snapshot:
    """The snapshot of ``offered`` (an ``offer``'s answer), received into new tensors."""
    tensors: dict[str, Any] = {}
    with socket.create_connection(tuple(offered["address"]), timeout=timeout_s) as conn:
        conn.sendall(offered["token"])
        for key, box in offered["boxes"].items():
            t = torch.empty(box["shape"], dtype=getattr(torch, box["dtype"]))
            if t.numel():
                _recv_into(conn, _flat_bytes(t))
            tensors[key] = ShardRecord(t, box["global_shape"], box["offsets"]) if "offsets" in box else t
    return Snapshot(offered["step"], offered["rank"], tensors, offered["objects"], offered["layout"], complete=True)


def receive_all(offers: dict[int, dict[str, Any]], timeout_s: float) -> dict[int, Snapshot]:
    """Several holders' offers at once (a resharding rank's overlapping shards), by owner."""
    if len(offers) <= 1:
        return {owner: receive(o, timeout_s) for owner, o in offers.items()}
    with ThreadPoolExecutor(max_workers=len(offers), thread_name_prefix="snapshot-receive") as pool:
        futures = {owner: pool.submit(receive, o, timeout_s) for owner, o in offers.items()}
        return {owner: f.result() for owner, f in futures.items()}
