"""Lifelines: one plain TCP connection from each agent (or aggregator) actor to its parent.

Why: when a node's processes are killed, the parent's Ray call to its agent does not fail at
once. Ray waits for the GCS to tell it why the actor is gone (about a second,
``timeout_ms_task_wait_for_death_info``), and when the node's raylet is killed too that word
never comes. Meanwhile the survivors compute on until their next collective, so the
detection of a node loss grew with the step (issue 29: 0.76 s after the kill at ~500 MB of
state, 0.15 s at ~50 MB). A kernel closes a dead process's sockets itself, so the parent
sees the lifeline's end within milliseconds, whatever the process was doing.

What a closed lifeline proves: the child's process is gone (it never closes its end while
it lives). It proves nothing about the node; the parent asks the node's raylet next
(``elastic/control/diagnosis.RayletProbe``). A machine that vanishes without its kernel
(power, network) closes nothing: then the long poll's silence is the evidence, as before.

Where it runs: ``LifelineServer`` in the driver (its direct channels) and in each
``Aggregator`` (its actor children); ``hold`` in the child actors (``actors.py``). Each
child is given a fresh ticket when it is linked, so a replaced child's old connection,
closing late, is not taken for the new one's.
"""

from __future__ import annotations

import logging
import secrets
import selectors
import socket
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

HELLO_MAX = 128  # bytes: a ticket and its newline
CONNECT_TIMEOUT_S = 5.0


class LifelineServer:
    """Accepts the children's lifelines and notes when one ends.

    ``ticket(key)`` gives the child ``key`` its ticket (the latest one counts); ``closed()``
    returns the keys whose current lifeline ended since the last call, with the time it
    ended (``time.monotonic``). ``on_close`` (optional) is called from the server's thread
    with the key, for a parent that waits on a condition."""

    def __init__(self, host: str, on_close: Callable[[str], None] | None = None):
        self._listener = socket.create_server((host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
        self._listener.setblocking(False)
        self.address: tuple[str, int] = (host, self._listener.getsockname()[1])
        self._on_close = on_close
        self._lock = threading.Lock()
        self._tickets: dict[str, str] = {}  # ticket -> key (current tickets only)
        self._current: dict[str, str] = {}  # key -> its current ticket
        self._ended: dict[str, float] = {}
        self.dropped = 0  # connections ended or refused (for tests)
        self.held = 0  # lifelines held now (for tests)
        self._stop = False
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ, None)
        self._thread = threading.Thread(target=self._serve, daemon=True, name="lifelines")
        self._thread.start()

    def ticket(self, key: str) -> str:
        t = secrets.token_hex(16)
        with self._lock:
            old = self._current.get(key)
            if old is not None:
                self._tickets.pop(old, None)
            self._current[key], self._tickets[t] = t, key
            self._ended.pop(key, None)
        return t

    def forget(self, key: str) -> None:
        """``key`` is gone for good (its node left): its lifeline's end is no news."""
        with self._lock:
            t = self._current.pop(key, None)
            if t is not None:
                self._tickets.pop(t, None)
            self._ended.pop(key, None)

    def closed(self) -> dict[str, float]:
        with self._lock:
            out, self._ended = self._ended, {}
        return out

    def close(self) -> None:
        self._stop = True
        self._thread.join(timeout=2.0)

    # ------------------------------------------------------------------ the server's thread
    def _serve(self) -> None:
        hello: dict[socket.socket, bytes] = {}  # connections that have not said their ticket yet
        linked: dict[socket.socket, str] = {}  # connection -> its ticket
        try:
            while not self._stop:
                for sk, _ in self._sel.select(timeout=0.5):
                    conn = sk.fileobj
                    if conn is self._listener:
                        self._accept(hello)
                        continue
                    assert isinstance(conn, socket.socket)
                    try:
                        data = conn.recv(HELLO_MAX)
                    except OSError:
                        data = b""
                    if conn in linked:
                        if not data:  # EOF or reset: the child's process is gone
                            self._end(linked.pop(conn))
                            self.held = len(linked)
                            self._drop(conn)
                        continue  # a child says nothing after its ticket
                    buf = hello.pop(conn, b"") + data
                    if data and b"\n" not in buf and len(buf) < HELLO_MAX:
                        hello[conn] = buf
                        continue
                    t = buf.split(b"\n", 1)[0].decode("ascii", "replace") if data else ""
                    with self._lock:
                        known = t in self._tickets
                    if known:
                        linked[conn] = t
                        self.held = len(linked)
                    else:  # no ticket of ours, or gone before saying it: not a child
                        self._drop(conn)
        finally:
            for conn in list(hello) + list(linked):
                self._drop(conn)
            self._sel.unregister(self._listener)
            self._listener.close()
            self._sel.close()

    def _accept(self, hello: dict[socket.socket, bytes]) -> None:
        try:
            conn, _ = self._listener.accept()
        except OSError:
            return
        conn.setblocking(False)
        self._sel.register(conn, selectors.EVENT_READ, None)
        hello[conn] = b""

    def _drop(self, conn: socket.socket) -> None:
        self.dropped += 1
        try:
            self._sel.unregister(conn)
        except (KeyError, ValueError):
            pass
        conn.close()

    def _end(self, t: str) -> None:
        now = time.monotonic()
        with self._lock:
            key = self._tickets.pop(t, None)
            if key is None or self._current.get(key) != t:
                return  # an old lifeline of a replaced child
            del self._current[key]
            self._ended[key] = now
        logger.debug("lifeline of %s ended", key)
        if self._on_close is not None:
            self._on_close(key)


def hold(address: tuple[str, int], ticket: str) -> socket.socket:
    """The child's end: connect, say the ticket, and keep the socket open for the life of the
    process (the caller keeps the returned socket; dropping it would close the lifeline)."""
    sock = socket.create_connection((address[0], address[1]), timeout=CONNECT_TIMEOUT_S)
    sock.sendall(ticket.encode("ascii") + b"\n")
    return sock
