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
"""

from __future__ import annotations

import logging
import os
import socket
import stat

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

    def before_init(self) -> None:
        self._before = socket_fds()

    def capture(self) -> None:
        """After the group and its mesh are built: every socket that was not there before."""
        now = socket_fds()
        self.sockets = {fd: inode for fd, inode in now.items() if self._before.get(fd) != inode}

    def cut(self) -> int:
        """Shut the captured sockets down; returns how many were still open."""
        cut = 0
        for fd, inode in self.sockets.items():
            try:
                dup = os.dup(fd)  # held: the socket checked below is the one shut down
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
            try:
                with s:
                    # Connected TCP streams only: gloo's listener thread aborts the process
                    # if its listening socket fails, and Unix sockets are not the group's.
                    if s.family not in (socket.AF_INET, socket.AF_INET6) or s.type != socket.SOCK_STREAM:
                        continue
                    if s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                        continue
                    s.shutdown(socket.SHUT_RDWR)
                cut += 1
            except OSError as exc:  # not connected, or already shut
                logger.debug("socket %d: %s", fd, exc)
        self.sockets = {}
        return cut
