"""The relay that authenticates every connection to the job's rendezvous store.

A ``TCPStore`` has no authentication hook: whoever reaches its port can list, read, write
and delete keys. It cannot be replaced by a store written in Python either, since NCCL's
bootstrap needs a C++ ``c10d::Store`` (docs/architecture.md). So the real ``TCPStore``
stays, unreachable, and relays carry its bytes:

* on the driver, the store listens on loopback only, and a :class:`StoreGate` listens
  where the workers connect (the driver's address on their network). A connection to the
  gate must prove the job's secret first (an HMAC over two fresh nonces, compared in
  constant time); one that does not is closed, and no byte of it ever reaches the store.
  Only then does the gate open a connection to the store and splice the two;
* on each worker, its ``TCPStore`` clients (and the clones c10d makes from C++) connect to
  a :class:`LocalRelay` on that host's loopback, which opens the connection to the gate,
  proves the secret, checks the gate's own proof (a gate without the secret is no gate of
  the job), and splices.

Loopback is shared by every user of a host, so two more locks close it:

* a ``LocalRelay`` admits only this process's own sockets: the connecting socket's inode
  (``/proc/net/tcp``) must be one of this process's descriptors. Otherwise anyone on the
  worker's host could use the relay to reach the store with the worker's credentials;
* the store's loopback listener requires TCP-MD5 signatures (``TCP_MD5SIG``, RFC 2385; a
  Linux socket option any user may set) with a key derived from the secret, for every
  peer in 127.0.0.0/8: the kernel drops an unsigned SYN, so a local user's connection is
  never even accepted. The gate signs its connections. ``signed_loopback`` reports
  whether the kernel took the option (where it did not, the store's loopback port is
  reachable by the host's other users, and the driver logs a warning).

The secret is the job's store secret (``RendezvousStore.secret``): it reaches the workers
inside their ``ConfigureRequest``, through Ray, never on a command line. Keys are derived
from it for each use, so the handshake, the loopback signature and the sealing of values
(``elastic/worker/job_store.py``) never share one.

Threads, not an event loop: one accept thread per relay, and two splicing threads per
connection (a blocking ``recv`` releases the GIL, and a store connection carries one
request at a time). Every wait is bounded: a handshake must finish within
``HANDSHAKE_TIMEOUT_S``; at most ``MAX_PENDING`` connections may be unproven at once
and at most ``max_connections`` live (a connection over either bound is closed at once);
``close()`` shuts every connection down and joins the threads. Refused connections are
counted (:class:`Denials`) so that a re-formation that fails meanwhile says so
(``elastic/control/worker_group/group.py``).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import socket
import struct
import threading
import time
from dataclasses import dataclass, field

from elastic.parallel.sockets import socket_fds

logger = logging.getLogger(__name__)

MAGIC = b"elastic-store-relay/1\n"
NONCE_BYTES = 32
MAC_BYTES = 32
HANDSHAKE_TIMEOUT_S = 5.0
MAX_PENDING = 64  # connections still proving the secret, at once
MAX_CONNECTIONS = 4096  # live connections a relay splices (the job's store clients)
ACCEPT_POLL_S = 0.5  # the accept thread looks at the closed flag this often
LOOPBACK = "127.0.0.1"
_PROC_TCP = ("/proc/net/tcp", "/proc/net/tcp6")
_TCP_MD5SIG = 14  # linux/tcp.h
_TCP_MD5SIG_EXT = 32
_TCP_MD5SIG_FLAG_PREFIX = 1
_TCP_STATE_LISTEN = "0A"
_TCP_STATES_GONE = {"06", "07"}  # TIME_WAIT, CLOSE


def derived_key(secret: str, use: bytes) -> bytes:
    """A key for one use of the job's secret (``b"relay"``, ``b"loopback"``)."""
    return hmac.new(hashlib.sha256(secret.encode()).digest(), b"store-relay/" + use, hashlib.sha256).digest()


def _proof(key: bytes, who: bytes, gate_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.new(key, who + gate_nonce + client_nonce, hashlib.sha256).digest()


# --------------------------------------------------------------------------- refusals
@dataclass
class Denials:
    """Connections a relay refused, since the last ``take``: by reason, and the last peers."""

    count: int = 0
    reasons: dict[str, int] = field(default_factory=dict)
    peers: list[str] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    KEEP_PEERS = 8

    def add(self, peer: str, reason: str) -> None:
        with self._lock:
            first = peer not in self.peers
            self.count += 1
            self.reasons[reason] = self.reasons.get(reason, 0) + 1
            if first:
                self.peers = (self.peers + [peer])[-self.KEEP_PEERS :]
        if first:  # one line per peer: a flood of refusals is counted, not logged
            logger.warning("rendezvous store: refused a connection from %s (%s)", peer, reason)

    def take(self) -> dict | None:
        """What was refused since the last call (None: nothing), and start counting again."""
        with self._lock:
            if not self.count:
                return None
            out = {"connections": self.count, "reasons": dict(self.reasons), "peers": list(self.peers)}
            self.count, self.reasons, self.peers = 0, {}, []
            return out


# --------------------------------------------------------------------------- loopback locks
def _md5sig_option(addr: str, key: bytes, prefix_len: int | None) -> bytes:
    """``struct tcp_md5sig`` for IPv4 peer ``addr`` (a prefix of ``prefix_len`` bits when given)."""
    sockaddr = (struct.pack("=H", socket.AF_INET) + struct.pack("!H", 0) + socket.inet_aton(addr)).ljust(128, b"\0")
    flags = _TCP_MD5SIG_FLAG_PREFIX if prefix_len is not None else 0
    return sockaddr + struct.pack("=BBHi", flags, prefix_len or 0, len(key), 0) + key.ljust(80, b"\0")


def require_signed_loopback(listener: socket.socket, key: bytes) -> bool:
    """Make the kernel drop every connection to ``listener`` from loopback (127.0.0.0/8) that
    is not signed with ``key``; False where the kernel does not offer TCP-MD5."""
    try:
        listener.setsockopt(socket.IPPROTO_TCP, _TCP_MD5SIG_EXT, _md5sig_option("127.0.0.0", key, 8))
    except OSError as exc:
        logger.debug("TCP_MD5SIG_EXT: %s", exc)
        return False
    return True


def sign_loopback(sock: socket.socket, key: bytes) -> None:
    """Sign ``sock``'s segments to ``LOOPBACK`` with ``key`` (call before connecting)."""
    try:
        sock.setsockopt(socket.IPPROTO_TCP, _TCP_MD5SIG, _md5sig_option(LOOPBACK, key, None))
    except OSError as exc:  # no TCP-MD5 here: the listener does not require it either
        logger.debug("TCP_MD5SIG: %s", exc)


def _tcp_rows() -> list[tuple[tuple[str, int], tuple[str, int], str, str]] | None:
    """This network namespace's TCP sockets, IPv4 (``/proc/net/tcp``) and IPv6
    (``/proc/net/tcp6``: torch's clients use IPv6 sockets, an IPv4 peer mapped as
    ``::ffff:a.b.c.d``, shown here as ``a.b.c.d``): (local, remote, state, inode); None
    without procfs."""
    rows = []
    for path in _PROC_TCP:
        try:
            with open(path) as f:
                lines = f.readlines()[1:]
        except FileNotFoundError:
            if path == _PROC_TCP[0]:
                return None
            continue  # no IPv6 here
        except OSError:
            return None
        for line in lines:
            parts = line.split()
            if len(parts) >= 10:
                rows.append((_addr(parts[1]), _addr(parts[2]), parts[3], parts[9]))
    return rows


def _addr(hex_addr: str) -> tuple[str, int]:
    """``/proc/net/tcp[6]``'s ``HEX:PORT`` (the address in 32-bit words of host byte order)."""
    ip, port = hex_addr.split(":")
    raw = b"".join(struct.pack("=I", int(ip[i : i + 8], 16)) for i in range(0, len(ip), 8))
    if len(raw) == 4:
        return socket.inet_ntoa(raw), int(port, 16)
    if raw[:12] == b"\0" * 10 + b"\xff\xff":  # an IPv4 peer of an IPv6 socket
        return socket.inet_ntoa(raw[12:]), int(port, 16)
    return socket.inet_ntop(socket.AF_INET6, raw), int(port, 16)


def _own_inodes() -> set[str]:
    return {target[len("socket:[") : -1] for target in socket_fds().values()}


def foreign_clients(port: int) -> list[tuple[str, int]] | None:
    """Sockets connected (or connecting) to ``LOOPBACK:port`` that are not this process's own:
    their local addresses. None where procfs cannot tell."""
    rows = _tcp_rows()
    if rows is None:
        return None
    mine = _own_inodes()
    return [
        local
        for local, remote, state, inode in rows
        if remote == (LOOPBACK, port) and state not in _TCP_STATES_GONE and state != _TCP_STATE_LISTEN
        if inode not in mine
    ]


def _is_own_connection(peer: tuple[str, int], port: int) -> bool | None:
    """Is the socket at ``peer``, connected to this process's ``LOOPBACK:port``, one of this
    process's own? None where procfs cannot tell."""
    rows = _tcp_rows()
    if rows is None:
        return None
    mine = _own_inodes()
    return any(local == peer and remote == (LOOPBACK, port) and inode in mine for local, remote, _, inode in rows)


# --------------------------------------------------------------------------- relays
def _recv_exact(sock: socket.socket, n: int, deadline: float) -> bytes | None:
    """``n`` bytes from ``sock`` before ``deadline`` (monotonic); None when they do not come."""
    buf = b""
    while len(buf) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        sock.settimeout(left)
        try:
            chunk = sock.recv(n - len(buf))
        except OSError:
            return None
        if not chunk:
            return None
        buf += chunk
    return buf


def _tune(sock: socket.socket, keepalive: bool) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if keepalive:  # a connection across hosts: notice a peer host that went away
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)


class _Pair:
    """A client connection and its upstream, spliced by two threads; either end closing closes both."""

    def __init__(self, down: socket.socket, up: socket.socket):
        self.down, self.up = down, up
        self._lock = threading.Lock()
        self._open = 2  # pumps still running: the last one closes the sockets

    def shut(self) -> None:
        for s in (self.down, self.up):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            self.shut()
            with self._lock:
                self._open -= 1
                last = self._open == 0
            if last:
                self.down.close()
                self.up.close()


class _Relay:
    """A listener whose every connection is first admitted (``_admit`` returns its upstream,
    or None to drop it), then spliced to that upstream."""

    keepalive_down = False  # True where the client side crosses hosts (the gate)

    def __init__(self, bind: tuple[str, int], max_connections: int = MAX_CONNECTIONS):
        self.denials = Denials()
        self.max_connections = max_connections
        family = socket.AF_INET6 if ":" in bind[0] else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.bind(bind)
        self._listener.listen(1024)
        self._listener.settimeout(ACCEPT_POLL_S)
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._closed = False
        self._pending = 0
        self._live: set[socket.socket] = set()  # every socket of an admitted or unproven connection
        self._pairs: set[_Pair] = set()
        self._threads: set[threading.Thread] = set()
        name = f"{type(self).__name__}-{self.port}"
        self._accepter = threading.Thread(target=self._accept_loop, name=name, daemon=True)
        self._accepter.start()

    def _admit(self, conn: socket.socket, peer: tuple[str, int], deadline: float) -> socket.socket | None:
        raise NotImplementedError

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, peer = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:  # closed under us
                return
            with self._lock:
                over = (
                    "over the connection limit"
                    if len(self._pairs) + self._pending >= self.max_connections
                    else "too many unproven connections"
                    if self._pending >= MAX_PENDING
                    else None
                )
                if over is None and not self._closed:
                    self._pending += 1
                    self._live.add(conn)
            if over is not None or self._closed:
                self.denials.add(_peer_name(peer), over or "closing")
                conn.close()
                continue
            t = threading.Thread(target=self._serve, args=(conn, peer), name=f"relay-{peer[1]}", daemon=True)
            with self._lock:
                self._threads.add(t)
            t.start()

    def _serve(self, conn: socket.socket, peer: tuple[str, int]) -> None:
        up: socket.socket | None = None
        try:
            up = self._admit(conn, peer, time.monotonic() + HANDSHAKE_TIMEOUT_S)
        except OSError as exc:
            logger.debug("relay %d: admitting %s: %s", self.port, peer, exc)
        except Exception:  # never leave a slot counted as pending: the connection is dropped
            logger.exception("relay %d: admitting %s", self.port, peer)
        with self._lock:
            self._pending -= 1
            self._live.discard(conn)
            if up is not None and self._closed:
                up.close()
                up = None
            if up is None:
                conn.close()
                self._threads.discard(threading.current_thread())
                return
            conn.settimeout(None)
            up.settimeout(None)
            _tune(conn, self.keepalive_down)
            pair = _Pair(conn, up)
            self._pairs.add(pair)
            back = threading.Thread(target=self._pump, args=(pair, up, conn), name=f"relay-{peer[1]}-up", daemon=True)
            self._threads.add(back)
        back.start()
        self._pump(pair, conn, up)

    def _pump(self, pair: _Pair, src: socket.socket, dst: socket.socket) -> None:
        try:
            pair.pump(src, dst)
        finally:
            with self._lock:
                self._pairs.discard(pair)
                self._threads.discard(threading.current_thread())

    @property
    def connections(self) -> int:
        """Live spliced connections."""
        with self._lock:
            return len(self._pairs)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop accepting, shut every connection down, and join the threads (within ``timeout_s``)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pairs, unproven = list(self._pairs), list(self._live)
        for pair in pairs:
            pair.shut()
        for conn in unproven:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept thread (Linux); else it polls
        except OSError:
            pass
        self._accepter.join(ACCEPT_POLL_S * 2 + 1)
        self._listener.close()
        deadline = time.monotonic() + timeout_s
        with self._lock:
            threads = list(self._threads)
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))


class StoreGate(_Relay):
    """The driver's public side of the rendezvous store: admits a connection that proves the
    job's secret, then splices it to the store on loopback (signed)."""

    keepalive_down = True

    def __init__(self, bind: tuple[str, int], store_port: int, secret: str, max_connections: int = MAX_CONNECTIONS):
        self._key = derived_key(secret, b"relay")
        self._loopback_key = derived_key(secret, b"loopback")
        self._store_port = store_port
        super().__init__(bind, max_connections)

    def _admit(self, conn: socket.socket, peer: tuple[str, int], deadline: float) -> socket.socket | None:
        gate_nonce = os.urandom(NONCE_BYTES)
        conn.settimeout(HANDSHAKE_TIMEOUT_S)
        conn.sendall(MAGIC + gate_nonce)
        answer = _recv_exact(conn, NONCE_BYTES + MAC_BYTES, deadline)
        if answer is None:
            self.denials.add(_peer_name(peer), "no proof of the job's secret")
            return None
        client_nonce, mac = answer[:NONCE_BYTES], answer[NONCE_BYTES:]
        if not hmac.compare_digest(mac, _proof(self._key, b"client", gate_nonce, client_nonce)):
            self.denials.add(_peer_name(peer), "wrong proof of the job's secret")
            return None
        conn.sendall(_proof(self._key, b"gate", gate_nonce, client_nonce))
        up = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sign_loopback(up, self._loopback_key)
            up.settimeout(max(0.1, deadline - time.monotonic()))
            up.connect((LOOPBACK, self._store_port))
            _tune(up, False)
        except OSError:
            up.close()
            raise
        return up


class LocalRelay(_Relay):
    """A worker's way to the job's store: its ``TCPStore`` clients connect here (loopback);
    each connection, if it is this process's own, is carried to the gate at ``gate`` with
    the proof of ``secret``. A gate that refuses (over its limits, restarting) is tried
    again until ``timeout_s`` runs out, so a flood at the gate delays a rank, not fails it."""

    def __init__(self, gate: tuple[str, int], secret: str, timeout_s: float, max_connections: int = 256):
        self.gate = (gate[0], int(gate[1]))
        self._key = derived_key(secret, b"relay")
        self._timeout_s = timeout_s
        self._warned_unverified = False
        super().__init__((LOOPBACK, 0), max_connections)

    def _admit(self, conn: socket.socket, peer: tuple[str, int], deadline: float) -> socket.socket | None:
        own = _is_own_connection((peer[0], peer[1]), self.port)
        if own is False:
            self.denials.add(_peer_name(peer), "not this process's connection")
            return None
        if own is None and not self._warned_unverified:  # no procfs (not Linux)
            self._warned_unverified = True
            logger.warning("rendezvous relay: this system cannot tell whose connection %s is; admitting it", peer)
        end = time.monotonic() + self._timeout_s
        pause = 0.05
        while True:
            up = self._connect_gate(min(end, time.monotonic() + HANDSHAKE_TIMEOUT_S))
            if up is not None or time.monotonic() + pause >= end or self._closed:
                return up
            time.sleep(pause)  # the gate refused or is not there yet: it may be over its limits
            pause = min(1.0, pause * 2)

    def _connect_gate(self, deadline: float) -> socket.socket | None:
        try:
            up = socket.create_connection(self.gate, timeout=max(0.1, deadline - time.monotonic()))
        except OSError as exc:
            logger.debug("rendezvous relay: gate %s: %s", self.gate, exc)
            return None
        try:
            hello = _recv_exact(up, len(MAGIC) + NONCE_BYTES, deadline)
            if hello is None or not hello.startswith(MAGIC):
                up.close()
                return None
            gate_nonce, client_nonce = hello[len(MAGIC) :], os.urandom(NONCE_BYTES)
            up.sendall(client_nonce + _proof(self._key, b"client", gate_nonce, client_nonce))
            answer = _recv_exact(up, MAC_BYTES, deadline)
            if answer is None:
                up.close()
                return None
            if not hmac.compare_digest(answer, _proof(self._key, b"gate", gate_nonce, client_nonce)):
                logger.warning("rendezvous relay: %s:%d answered without the job's secret", *self.gate)
                up.close()
                return None
            _tune(up, True)
            return up
        except OSError as exc:
            logger.debug("rendezvous relay: gate %s: %s", self.gate, exc)
            up.close()
            return None


def _peer_name(peer: tuple) -> str:
    return f"{peer[0]}:{peer[1]}"
