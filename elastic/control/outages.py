"""Outages and their recoveries, timed on the driver's clock (``summary.json`` ``recoveries``).

An outage starts at the first failure and ends when the first step at the new size is done
by every rank. A failure that comes while an outage is still open (during the recovery, or
after the re-formation but before that first step) is part of the same outage: one record,
its downtime counted once from the first failure, ``failures`` telling how many failures it
took. Two records for one outage would count the same seconds twice.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from elastic.events import Recovery


@dataclass
class _Open:
    cause: str
    failed_at: float
    detected_at: float
    lost_steps: int = 0
    failures: int = 1
    breakdown: dict[str, float] = field(default_factory=dict)
    configured_at: float | None = None


class Outages:
    """The open outage, if any, and the recoveries closed so far."""

    def __init__(self) -> None:
        self.closed: list[Recovery] = []
        self._open: _Open | None = None

    def record(self, recovery: Recovery) -> None:
        """A rollback in place (NaN, spike, SDC): nothing paused, its cost is the steps redone."""
        self.closed.append(recovery)

    @property
    def is_open(self) -> bool:
        return self._open is not None

    def failed(self, cause: str, failed_at: float, detected_at: float) -> None:
        """A failure was diagnosed: it opens an outage, or joins the open one."""
        if self._open is None:
            self._open = _Open(cause, failed_at, detected_at)
            return
        self._open.failures += 1
        self._open.configured_at = None  # the re-formation it interrupted does not count

    def lost(self, steps: int) -> None:
        """Steps the open outage made the job redo (the largest count seen wins)."""
        if self._open is not None:
            self._open.lost_steps = max(self._open.lost_steps, max(0, steps))

    def reformed(self, breakdown: dict[str, float], configured_at: float) -> None:
        """The group re-formed at its new size; the outage closes at its first step."""
        if self._open is not None:
            self._open.breakdown = dict(breakdown)
            self._open.configured_at = configured_at

    def first_step(self, now: float) -> Recovery | None:
        """The first step at the new size is done: close the outage (if it re-formed)."""
        o = self._open
        if o is None or o.configured_at is None:
            return None
        breakdown = dict(o.breakdown, first_step_s=round(max(0.0, now - o.configured_at), 3))
        recovery = Recovery(
            cause=o.cause,
            detect_s=round(max(0.0, o.detected_at - o.failed_at), 3),
            recover_s=round(now - o.detected_at, 3),
            downtime_s=round(now - o.failed_at, 3),
            lost_steps=o.lost_steps,
            breakdown=breakdown,
            failures=o.failures,
        )
        self.closed.append(recovery)
        self._open = None
        return recovery
