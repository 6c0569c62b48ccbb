"""The relays in front of the job's rendezvous store let nobody in without the job's secret.

Real parts: the driver's ``RendezvousStore`` (a real ``TCPStore`` on loopback, behind its
``StoreGate``), real ``TCPStore`` clients through a ``LocalRelay``, raw sockets, another
process on this host, and an impostor relay that speaks the handshake with a wrong secret
and sends a real client's requests whatever the gate answers. Every outsider is dropped,
and the key the job wrote is there afterwards with its value. The gloo group through the
relays: ``tests/worker/test_rendezvous_store.py``.
"""

from __future__ import annotations

import datetime
import os
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch.distributed as dist

from elastic.errors import RendezvousFailed, failure_fields
from elastic.worker import store_relay
from elastic.worker.job_store import JobStore
from elastic.worker.process_group import RendezvousStore
from elastic.worker.store_relay import MAC_BYTES, MAGIC, NONCE_BYTES, LocalRelay

pytestmark = pytest.mark.timeout(60)

TIMEOUT = datetime.timedelta(seconds=5)


@pytest.fixture
def store():
    server = RendezvousStore("127.0.0.1", 10)
    yield server
    server.close()


def _client(relay: LocalRelay, timeout: datetime.timedelta = TIMEOUT) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", relay.port, is_master=False, timeout=timeout)


def _recv_all(s: socket.socket, timeout_s: float) -> bytes:
    """Everything ``s`` receives until it is closed or reset (``timeout_s`` passing raises)."""
    s.settimeout(timeout_s)
    out = b""
    try:
        while chunk := s.recv(4096):
            out += chunk
    except ConnectionResetError:  # closed with bytes of ours unread: reset
        pass
    return out


class ImpostorRelay(LocalRelay):
    """Speaks the gate's handshake with a wrong secret, and then carries its client's requests
    whatever the gate answered: only the gate's own check can stop them."""

    def _connect_gate(self, deadline: float) -> socket.socket | None:
        up = socket.create_connection(self.gate, timeout=2)
        hello = up.recv(len(MAGIC) + NONCE_BYTES)
        up.sendall(os.urandom(NONCE_BYTES) + store_relay._proof(self._key, b"client", hello[len(MAGIC) :], b"x"))
        up.settimeout(2)
        try:
            up.recv(MAC_BYTES)  # the gate's proof, if it gave one: ignored
        except OSError:
            pass
        return up


def test_a_client_through_its_relay_reads_writes_and_deletes(store):
    relay = LocalRelay(store.address, store.secret, 5)
    try:
        client = _client(relay)
        client.set("k", b"v")
        assert client.get("k") == b"v" and store._store.get("k") == b"v"  # the same store, behind the gate
        assert client.add("n", 2) == 2
        twin = client.clone()  # what c10d does from C++ for NCCL: a second connection, through the relay
        assert twin.get("n") == b"2"
        assert client.delete_key("k") and not store._store.check(["k"])
        assert relay.connections == 2 and store._gate.connections == 2
        assert store.take_denials() is None and relay.denials.take() is None
    finally:
        relay.close()


def test_outsiders_read_write_and_delete_nothing_and_are_dropped(store):
    relay = LocalRelay(store.address, store.secret, 5)
    try:
        job = JobStore(_client(relay), store.secret)
        job.set("gen1/0", b"10.0.0.1:1234")  # a set is not answered: the get below is its round trip
        assert job.get("gen1/0") == b"10.0.0.1:1234"
        keys = store._store.list_keys()
        assert len(keys) == 1
        host, port = store.address

        # A plain TCPStore client on the gate's port: its first request is never answered.
        with pytest.raises(dist.DistNetworkError):
            dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=1))
        # A raw socket with 64 bytes of anything: closed as soon as they are read.
        with socket.create_connection((host, port), timeout=2) as s:
            s.sendall(b"\x00" * (NONCE_BYTES + MAC_BYTES) + job.name("gen1/0").encode())
            t0 = time.monotonic()
            assert len(_recv_all(s, 2)) <= len(MAGIC) + NONCE_BYTES  # the hello at most, then the close
            assert time.monotonic() - t0 < 1.0
        # A wrong secret, and a wrong secret that pushes its requests anyway.
        for cls in (LocalRelay, ImpostorRelay):
            wrong = cls(store.address, "0" * 64, 1)
            try:
                with pytest.raises(dist.DistNetworkError):
                    outsider = _client(wrong, datetime.timedelta(seconds=1))
                    outsider.delete_key(job.name("gen1/0"))  # reached only if the gate let it through
            finally:
                wrong.close()
        # Nothing but loopback signed with the job's key reaches the store itself.
        assert store.signed_loopback
        with socket.socket() as s:
            s.settimeout(1)
            with pytest.raises(OSError):
                s.connect(("127.0.0.1", store.loopback_port))

        assert store._store.list_keys() == keys and job.get("gen1/0") == b"10.0.0.1:1234"
        denied = store.take_denials()
        assert denied is not None and denied["connections"] >= 4
        assert denied["reasons"].keys() == {"no proof of the job's secret", "wrong proof of the job's secret"}
        assert store._gate.connections == 1  # the job's own client only
    finally:
        relay.close()


def test_a_silent_connection_is_dropped_after_the_handshake_timeout(store, monkeypatch):
    monkeypatch.setattr(store_relay, "HANDSHAKE_TIMEOUT_S", 0.3)
    with socket.create_connection(store.address, timeout=2) as s:
        t0 = time.monotonic()
        assert len(_recv_all(s, 3)) == len(MAGIC) + NONCE_BYTES
        assert 0.2 < time.monotonic() - t0 < 2.0
    assert store.take_denials()["reasons"] == {"no proof of the job's secret": 1}


def test_connections_over_the_bound_are_closed_at_once():
    server = RendezvousStore("127.0.0.1", 10, max_connections=1)
    try:
        with socket.create_connection(server.address, timeout=2) as first:  # holds the one slot, unproven
            first.recv(len(MAGIC) + NONCE_BYTES)
            with socket.create_connection(server.address, timeout=2) as second:
                assert _recv_all(second, 2) == b""  # not even the hello
        reasons = server.take_denials()["reasons"]
        # The first connection may also have run out its handshake time meanwhile (a loaded machine).
        assert reasons.get("over the connection limit") == 1 and set(reasons) <= {
            "over the connection limit",
            "no proof of the job's secret",
        }, reasons
    finally:
        server.close()


def test_a_local_relay_admits_only_its_own_processs_connections(store):
    """Another process on the host (the same user, here) that connects to a worker's relay
    is dropped before the relay opens anything to the gate."""
    relay = LocalRelay(store.address, store.secret, 5)
    try:
        code = (
            "import socket, sys\n"
            f"s = socket.create_connection(('127.0.0.1', {relay.port}), timeout=5)\n"
            "s.sendall(b'x' * 16)\n"
            "try:\n    sys.exit(0 if s.recv(16) == b'' else 1)\nexcept ConnectionResetError:\n    sys.exit(0)\n"
        )
        assert subprocess.run([sys.executable, "-c", code], timeout=30).returncode == 0
        assert relay.denials.take()["reasons"] == {"not this process's connection": 1}
        assert store._gate.connections == 0 and store.take_denials() is None
    finally:
        relay.close()


def test_close_frees_a_blocked_client_and_ends_every_relay_thread():
    server = RendezvousStore("127.0.0.1", 10)
    relay = LocalRelay(server.address, server.secret, 5)
    client = _client(relay, datetime.timedelta(seconds=30))
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            client.wait(["never"])
        except Exception as exc:  # the store went away under the wait
            errors.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.2)  # the wait is on the server
    t0 = time.monotonic()
    server.close()
    waiter.join(30)  # seconds on an idle machine; the bound tells freed from blocked for ever under load
    assert not waiter.is_alive() and errors and time.monotonic() - t0 < 30
    relay.close()
    names = [t.name for t in threading.enumerate()]
    assert not [n for n in names if n.startswith(("relay-", "StoreGate-", "LocalRelay-"))], names


def test_a_failure_says_the_store_refused_outsiders_meanwhile(store):
    """A re-formation that fails while outsiders were refused is not charged in silence: its
    ``failure`` event carries ``store_denied`` and its detail says so."""
    with socket.create_connection(store.address, timeout=2) as s:
        s.sendall(b"\x00" * (NONCE_BYTES + MAC_BYTES))
        _recv_all(s, 2)
    failure = RendezvousFailed("configure failed: DistStoreError: Socket Timeout", ranks=[0, 1])
    failure.note_store_denials(store.take_denials())
    fields = failure_fields(failure)
    assert fields["store_denied"]["connections"] == 1
    assert fields["store_denied"]["reasons"] == {"wrong proof of the job's secret": 1}
    assert "refused 1 connection(s) from outside the job" in fields["detail"]
    assert "counted against elastic.max_failures" in fields["detail"]
    plain = RendezvousFailed("configure failed: DistStoreError: Socket Timeout")
    plain.note_store_denials(store.take_denials())  # nothing refused since
    assert "store_denied" not in failure_fields(plain)


def test_a_connection_made_before_the_store_was_locked_is_found():
    """``RendezvousStore`` locks its loopback listener only after the store's own client has
    connected; whoever connected before is found (``foreign_clients``: not this process's
    socket) and the store is built again. Here a listener left unlocked, with a connection of
    this process's and one from another process."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)
        port = listener.getsockname()[1]
        mine = socket.create_connection(("127.0.0.1", port), timeout=2)
        other = subprocess.Popen(
            [
                sys.executable,
                "-c",
                f"import socket, sys; s = socket.create_connection(('127.0.0.1', {port})); sys.stdin.read()",
            ],
            stdin=subprocess.PIPE,
        )
        try:
            deadline = time.monotonic() + 20
            while not (found := store_relay.foreign_clients(port)) and time.monotonic() < deadline:
                time.sleep(0.05)  # the other process is starting
            assert len(found) == 1 and found[0] != mine.getsockname()
        finally:
            other.communicate(b"", timeout=10)
            mine.close()


def test_where_the_loopback_port_is_not_signed_its_outside_clients_are_named(monkeypatch):
    """A kernel without TCP-MD5: the store's loopback port is open to the host, so the
    clients on it that are not the driver's own are reported with the gate's refusals
    (keys they delete would fail a re-formation)."""
    monkeypatch.setattr("elastic.worker.process_group.require_signed_loopback", lambda listener, key: False)
    server = RendezvousStore("127.0.0.1", 10)
    try:
        assert not server.signed_loopback
        code = (
            "import socket, sys\n"
            f"s = socket.create_connection(('127.0.0.1', {server.loopback_port}))\n"
            "print('connected', flush=True)\n"
            "sys.stdin.read()\n"
        )
        other = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        try:
            assert other.stdout is not None and other.stdout.readline() == b"connected\n"
            denied = server.take_denials()
            assert denied is not None
            assert denied["reasons"] == {"connected to the store's unsigned loopback port": 1}
        finally:
            other.communicate(b"", timeout=10)
    finally:
        server.close()
