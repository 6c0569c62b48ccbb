"""A free TCP port for test and benchmark harnesses (a ``tcp://`` rendezvous, a Ray head).

Bind, read, close, hand on: another process may take the port in between, which is why
the product itself never does this (workers meet on the driver's ``TCPStore``, bound to
port 0 by the process that serves it: ``elastic/worker/process_group.py``). Harnesses on
one test machine accept the small risk; this is the one copy of the helper.
"""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(1, host)[0]


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct free ports: each socket stays bound until all are picked (one by one,
    the kernel may hand the same port out twice: a Ray head then refused two of its
    components on one port)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()
