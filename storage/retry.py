"""Retry with exponential backoff for transient storage errors.

Background uploads must survive short object-store outages (connection refused, timeouts,
throttling) without failing a training run, yet must give up at a deadline so that a stuck
upload does not hold a snapshot in memory forever. Errors that retrying cannot fix (missing
file, permission denied, no space left, read-only filesystem, bad argument) are raised at once.
"""

from __future__ import annotations

import errno
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from storage.errors import StorageUnavailable

log = logging.getLogger(__name__)
T = TypeVar("T")

# A full disk, a read-only filesystem, an exhausted quota or a missing permission do not go
# away within a retry deadline, and retrying them holds the snapshot and delays the report.
_PERMANENT_ERRNOS = {
    errno.ENOENT,
    errno.EACCES,
    errno.EPERM,
    errno.EISDIR,
    errno.ENOTDIR,
    errno.EEXIST,
    errno.EINVAL,
    errno.ENOSPC,
    errno.EROFS,
    errno.EDQUOT,
    errno.EFBIG,
    errno.ENAMETOOLONG,
}
_PERMANENT_OS_ERRORS = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, FileExistsError)
# botocore/aiohttp raise their own (non-OSError) types for network failures; match them by name
# so that ``storage`` does not have to import botocore for local-only use.
_TRANSIENT_NAMES = {
    "EndpointConnectionError",
    "ConnectionClosedError",
    "ConnectTimeoutError",
    "ReadTimeoutError",
    "HTTPClientError",
    "ResponseStreamingError",
    "IncompleteReadError",
    "ClientConnectorError",
    "ServerDisconnectedError",
    "ClientPayloadError",
    "ServerTimeoutError",
    "ProxyConnectionError",
}


def is_transient(exc: BaseException) -> bool:
    """True when retrying the same storage call later may succeed."""
    if isinstance(exc, _PERMANENT_OS_ERRORS):
        return False
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    if isinstance(exc, OSError):
        return exc.errno not in _PERMANENT_ERRNOS
    return any(cls.__name__ in _TRANSIENT_NAMES for cls in type(exc).__mro__)


@dataclass(frozen=True)
class RetryPolicy:
    """Backoff schedule: ``initial_s * multiplier**n`` capped at ``max_s``, with +-``jitter``.

    ``deadline_s`` bounds one operation (one file upload, one read) from its first attempt.
    ``on_retry(what, attempt, error, sleep_s)`` is called before each sleep (metrics, tests).
    """

    initial_s: float = 0.5
    multiplier: float = 2.0
    max_s: float = 15.0
    deadline_s: float = 300.0
    jitter: float = 0.1
    on_retry: Callable[[str, int, BaseException, float], None] | None = None

    def backoff(self, attempt: int) -> float:
        base = min(self.max_s, self.initial_s * self.multiplier ** max(0, attempt - 1))
        return max(0.0, base * (1.0 + random.uniform(-self.jitter, self.jitter)))


def call_with_retry(fn: Callable[[], T], policy: RetryPolicy, what: str) -> T:
    """Run ``fn`` until it succeeds, a permanent error occurs, or the deadline passes.

    Raises :class:`StorageUnavailable` (chained to the last error) when transient errors outlast
    ``policy.deadline_s``; permanent errors propagate unchanged.
    """
    start = time.monotonic()
    attempt = 0
    while True:
        attempt += 1
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - classified just below
            if not is_transient(exc):
                raise
            elapsed = time.monotonic() - start
            sleep_s = policy.backoff(attempt)
            if elapsed + sleep_s > policy.deadline_s:
                log.error(
                    "giving up on %s after %d attempts in %.1fs: %s: %s",
                    what,
                    attempt,
                    elapsed,
                    type(exc).__name__,
                    exc,
                )
                raise StorageUnavailable(what, attempt, elapsed, exc) from exc
            log.warning(
                "transient storage error on %s (attempt %d): %s: %s; retrying in %.2fs",
                what,
                attempt,
                type(exc).__name__,
                exc,
                sleep_s,
            )
            if policy.on_retry is not None:
                policy.on_retry(what, attempt, exc, sleep_s)
            time.sleep(sleep_s)
