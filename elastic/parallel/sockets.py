"""Cut a process group's TCP connections, so that peers blocked on this rank fail at once.

A gloo process group closes its connections only when the last reference to it goes, and
references can survive in C++ (a half-built autograd graph, a queued FSDP callback, a
pending work object) where Python cannot drop them. Its ``abort()``/``shutdown()`` leave
the sockets open. Peers blocked in a collective with this rank then wait for the full
collective timeout, although this rank will never answer.

So the worker notes which sockets appear while it builds a process group and its mesh
(``GroupSockets.capture``), and on a failure shuts those sockets down
(``GroupSockets.cut``). For the peers, that looks exactly like this process dying: their
collective fails with "Connection closed by peer" within milliseconds. Only connected TCP
streams are shut down (a listener is left alone: gloo's accept thread aborts the process
when its listener fails), through a duplicate descriptor, and only if the descriptor still
refers to the same socket, so a number reused by something else is never touched.

Cutting only the links to a lost peer (``cut(links=...)``). A survivor blocked in a
collective with a rank that died is freed only when the dead process's sockets close, and
the kernel closes them after it has freed the process's memory: 130-214 ms for a rank
holding about 2 GB on a loaded 2-core host (a stack dump of an HSDP recovery, 2026-11-27),
and never for a node that lost power. So each rank reports the connections it captured
(``connections``: ``(local host, local port, peer host, peer port)``) with its configure
answer, and when the driver gives up a rank it sends the survivors that rank's connections
seen from their side (``links_to``); each survivor shuts down exactly those, and nothing
else: its links to live peers stay up. A TCP connection is named by its four parts, so a
link to the lost rank cannot be confused with one to a live peer, on one host or many.
"""

from __future__ import annotations

import logging
import os
import socket
import stat
from collections.abc import Collection, Iterator

from elastic.messages import Connection

logger = logging.getLogger(__name__)

_FD_DIR = "/proc/self/fd"


def socket_fds() -> dict[int, str]:
    """This process's socket descriptors: fd -> ``socket:[inode]``."""
    out: dict[int, str] = {}
    try:
        names = os.listdir(_FD_DIR)
    except OSError:  # no procfs (not Linux): nothing to track
        return out
    for name in names:
        try:
            target = os.readlink(os.path.join(_FD_DIR, name))
        except OSError:
            continue
        if target.startswith("socket:"):
            out[int(name)] = target
    return out


class GroupSockets:
    """The sockets a process group (and its mesh's sub-groups) opened."""

    def __init__(self) -> None:
        self._before: dict[int, str] = {}
        self.sockets: dict[int, str] = {}
        self.connections: tuple[Connection, ...] = ()  # the captured TCP streams' endpoints

    def before_init(self) -> None:
        self._before = socket_fds()

    def capture(self) -> None:
        """After the group and its mesh are built: every socket that was not there before."""
        now = socket_fds()
        self.sockets = {fd: inode for fd, inode in now.items() if self._before.get(fd) != inode}
        connections = []
        for _, s in self._streams():
            with s:
                ends = _endpoints(s)
            if ends[3]:  # connected (a lazily connecting pair is not, yet)
                connections.append(ends)
        self.connections = tuple(sorted(connections))

    def cut(self, links: Collection[Connection] | None = None) -> int:
        """Shut the captured sockets down; returns how many were shut.

        ``links``: only the connections named there (``(local host, local port, peer host,
        peer port)`` as this rank sees them; ``links_to``), the rest stay captured and open.
        Without it, every captured one, and the capture is forgotten."""
        cut = 0
        for fd, s in self._streams():
            with s:
                try:
                    if links is not None and _endpoints(s) not in links:
                        continue
                    s.shutdown(socket.SHUT_RDWR)
                    cut += 1
                except OSError as exc:  # not connected, or already shut
                    logger.debug("socket %d: %s", fd, exc)
        if links is None:
            self.sockets = {}
        return cut

    def census(self) -> dict[str, int]:
        """What became of the captured sockets: ``connected`` TCP streams, ``unconnected`` ones
        (shut down, or their peer gone), ``other`` (closed, the number reused, or not a TCP
        stream: the group's listener). Logged when a cut finds nothing to shut."""
        out = {"captured": len(self.sockets), "connected": 0, "unconnected": 0}
        for _, s in self._streams():
            with s:
                out["connected" if _endpoints(s)[3] else "unconnected"] += 1
        out["other"] = out["captured"] - out["connected"] - out["unconnected"]
        return out

    def _streams(self) -> Iterator[tuple[int, socket.socket]]:
        """Each captured socket that is still the one captured and a connected TCP stream, as
        a socket object over a duplicate descriptor (the caller closes it)."""
        for fd, inode in list(self.sockets.items()):
            try:
                dup = os.dup(fd)  # held: the socket checked below is the one used
            except OSError:
                continue  # closed already
            st = os.fstat(dup)
            if not stat.S_ISSOCK(st.st_mode) or f"socket:[{st.st_ino}]" != inode:
                os.close(dup)  # the number now belongs to another socket (gloo and Ray open and
                continue  # close theirs on other threads: checked on the duplicate, not before it)
            try:
                s = socket.socket(fileno=dup)
            except OSError:
                os.close(dup)
                continue
            # Connected TCP streams only: gloo's listener thread aborts the process if its
            # listening socket fails, and Unix sockets are not the group's.
            try:
                stream = s.family in (socket.AF_INET, socket.AF_INET6) and s.type == socket.SOCK_STREAM
                if stream and not s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                    yield fd, s
                    continue
            except OSError as exc:
                logger.debug("socket %d: %s", fd, exc)
            s.close()


def _endpoints(s: socket.socket) -> Connection:
    """``(local host, local port, peer host, peer port)``; the peer is ``("", 0)`` when the
    stream is no longer connected."""
    try:
        local = s.getsockname()
    except OSError:
        local = ("", 0)
    try:
        peer = s.getpeername()
    except OSError:
        peer = ("", 0)
    return (str(local[0]), int(local[1]), str(peer[0]), int(peer[1]))
