"""Liveness that a busy process cannot fake (pure; used by agents for their ranks and by the
driver for its channels).

A peer is silent only when a request issued to it is still unanswered past the time its
answer was due, by at least the timeout. Replies are taken in before anything is judged
(the owner processes every reply that has arrived first), so a process that was itself
stalled (a long step of its own, a GC pause) sees the answers that came meanwhile and
blames nobody: its own stall delays its judgement, it does not age its peers.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Generic, TypeVar

STARTUP_GRACE_S = 60.0  # a new actor's first answer may take this much longer: its process starts first

K = TypeVar("K", bound=Hashable)  # how the owner names its peers (a worker id, a tree key)


class Outstanding(Generic[K]):
    """One request in flight per key, and when its answer is due (any monotonic clock)."""

    def __init__(self) -> None:
        self._due: dict[K, float] = {}

    def issued(self, key: K, now: float, answer_within_s: float) -> None:
        """A request to ``key`` left now; a long poll is due back after its wait."""
        self._due[key] = now + answer_within_s

    def unreachable(self, key: K, now: float) -> None:
        """The request could not reach ``key`` (its connection failed): its answer is due
        now, not at the end of a long poll it never started, so silence counts from here."""
        self._due[key] = min(self._due.get(key, now), now)

    def answered(self, key: K) -> None:
        self._due.pop(key, None)

    def forget(self, key: K) -> None:
        self._due.pop(key, None)

    def in_flight(self, key: K) -> bool:
        return key in self._due

    def overdue_s(self, key: K, now: float) -> float:
        """How long ``key``'s answer is past due (0 when none is in flight or not yet due)."""
        due = self._due.get(key)
        return 0.0 if due is None else max(0.0, now - due)

    def silent(self, now: float, threshold_s: float) -> dict[K, float]:
        """Every key overdue by at least ``threshold_s``, with how long."""
        return {k: now - due for k, due in self._due.items() if now - due >= threshold_s}

    def next_deadline(self, threshold_s: float) -> float | None:
        """The earliest time some key would become silent (for the owner's next wake-up)."""
        return min(self._due.values()) + threshold_s if self._due else None
