"""Which Ray cluster a command joins, and joining it (driver side: ``elastic run``, ``sweep``,
``prepare``, ``plan``, the Python API).

Ray's own convention (DESIGN §10, docs/cli.md):

- ``--address ADDR`` (or, without it, ``RAY_ADDRESS``): join that cluster;
- ``--address auto``: join the cluster running on this machine, found from Ray's local
  record (``/tmp/ray/ray_current_cluster``); an error when none answers;
- neither: start an embedded cluster for this command alone.

A recorded local cluster is never joined silently: the record lives in a world-writable
folder, so any user of the machine can point it anywhere, and the job (and the storage
credentials in its spec) would go there. An address that does not answer is refused at
once (exit 2, naming ``--address`` or ``RAY_ADDRESS``): ``ray.init`` would otherwise retry
it for minutes. Ray failing to start or to connect is one line (exit 1), not a traceback.
"""

from __future__ import annotations

import logging
import os
import socket
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from elastic.errors import JobFailed, SpecError

PROBE_TIMEOUT_S = 3.0
QUIET_LOG_LEVEL = logging.WARNING  # Ray's own logging on the driver; workers' logs are not forwarded


@dataclass(frozen=True)
class Target:
    """Where to run: ``address`` None means an embedded cluster; ``field`` names where the
    address came from (``--address`` or ``RAY_ADDRESS``), for errors."""

    address: str | None
    field: str = "--address"


def resolve(address: str | None) -> Target:
    """The cluster a command joins (see the module docstring); refuses one that does not answer."""
    field = "--address"
    if not address:
        address, field = os.environ.get("RAY_ADDRESS") or None, "RAY_ADDRESS"
    if not address or address == "local":
        return Target(None, field)
    if address == "auto":
        recorded = recorded_cluster()
        if recorded is None or not answers(recorded):
            raise SpecError(
                field,
                "auto: no Ray cluster is running on this machine (start one with `ray start --head`, "
                "or leave --address out to run on an embedded one)",
            )
        # "auto", not the recorded address: Ray then uses the local token by itself (it sends
        # one unasked only to a cluster it found on its own, never to a named address).
        return Target("auto", field)
    hostport = address.split("://", 1)[1] if "://" in address else address
    if not answers(hostport):
        raise SpecError(field, f"no Ray cluster answers at {address} (nothing accepts connections there)")
    return Target(address, field)


def recorded_cluster() -> str | None:
    """The head address Ray recorded on this machine (the last ``ray start --head``), or None."""
    path = os.path.join(tempfile.gettempdir(), "ray", "ray_current_cluster")
    try:
        with open(path) as f:
            return f.read().strip() or None
    except OSError:
        return None


def answers(hostport: str, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """Does something accept TCP connections at ``host:port``?"""
    host, _, port = hostport.rstrip("/").rpartition(":")
    try:
        with socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


def connect(target: Target, start_embedded: Callable[[], None]) -> bool:
    """Join ``target``, or call ``start_embedded`` (a ``ray.init`` of a local cluster); True
    when this call started one. Already connected: nothing to do."""
    import ray

    if ray.is_initialized():
        return False
    try:
        if target.address is None:
            start_embedded()
            return True
        ray.init(address=target.address, log_to_driver=False, logging_level=QUIET_LOG_LEVEL)
        private_token_file()
        return False
    except (SpecError, JobFailed):
        raise
    except Exception as exc:  # noqa: BLE001 - Ray's own errors: one line with the cause
        where = f"join the Ray cluster at {target.address}" if target.address else "start an embedded Ray cluster"
        raise JobFailed(f"could not {where}: {type(exc).__name__}: {_one_line(exc)}") from None


def embedded(num_cpus: int, **init: Any) -> Callable[[], None]:
    """A ``start_embedded`` for :func:`connect`: a local cluster of ``num_cpus`` logical CPUs."""

    def start() -> None:
        import ray

        ray.init(
            address="local",
            num_cpus=int(num_cpus),
            include_dashboard=False,
            log_to_driver=False,
            logging_level=QUIET_LOG_LEVEL,
            **init,
        )
        private_token_file()

    return start


def private_token_file() -> None:
    """Make Ray's token file (``~/.ray/auth_token``) readable by its owner only.

    Ray writes the token it generates for a new local cluster with the process's umask
    (0644 on most hosts), so any user of the machine could read it and join the cluster; it
    is a password, so it is made 0600, as ``ssh`` keeps its keys. A file another user owns
    is left alone (it is not ours to change)."""
    path = os.path.join(os.path.expanduser("~"), ".ray", "auth_token")
    try:
        st = os.lstat(path)
    except OSError:
        return
    if st.st_uid == os.getuid() and st.st_mode & 0o077 and not os.path.islink(path):
        os.chmod(path, 0o600)


def _one_line(exc: BaseException, limit: int = 300) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
