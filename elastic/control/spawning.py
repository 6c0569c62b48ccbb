"""New workers whose start is under way: the controller keeps watching the job meanwhile.

Runs in the driver. A worker's start (its process, torch's imports) takes seconds, and tens
of seconds on a loaded host (about 50 s for the ~100M grow-back here). A grow-back starts
its new workers while the job trains on; if the controller waited for them, it would stop
watching the job for that long: a failure would go unseen, checkpoints would not be
committed, a stop signal would not be acted on (seen: a grow-back's storage commits came up
to 59 s late, all at once when the new worker answered). So the start is split: ``WorkerGroup.spawn_begin``
creates the actors and asks each for its ``info()``, and ``PendingSpawn.infos`` looks at
their answers without blocking, until every one has answered or the start has stalled.

A start is late only when it stalls: no new worker answered for ``stall_s`` (``RPC_TIMEOUT_S``)
since it began or since the last one did. A fixed deadline for the whole start would fail
a slow one that is making progress (Ray starts a node's worker processes a few at a time,
each importing torch: on an oversubscribed host a start of many workers can take minutes),
and the start that follows it, with fresh processes, cannot be faster. A worker that is
lost (its process or node died) fails the start at once, whatever the clock says.

A stalled start says what Ray's GCS knows of the workers that did not answer, counted by
actor state: ``PENDING_CREATION`` (Ray has not started the process, or its constructor has
not returned: a slow or starved host), ``ALIVE`` (constructed, but ``info()`` not answered),
``DEPENDENCIES_UNREADY`` (its arguments are not there yet).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, NoReturn

import ray
from ray.exceptions import ActorUnavailableError, GetTimeoutError

from elastic.agent.aggregator import ACTOR_GONE
from elastic.errors import ActorDied
from elastic.messages import WorkerInfo

logger = logging.getLogger(__name__)


@dataclass
class PendingSpawn:
    """The actors of one start, in order: ``(slot, bundle, actor)``, and their ``info()`` answers."""

    actors: list[tuple[Any, int, Any]]
    refs: list[Any]
    stall_s: float  # the longest time without a new answer before the start is late
    got: dict[Any, WorkerInfo] = field(default_factory=dict)  # the answers so far, by ref
    progress_at: float = field(default_factory=time.monotonic)  # the start, or the last new answer

    @property
    def deadline(self) -> float:
        """When the start is late unless another worker answers first (driver's monotonic clock)."""
        return self.progress_at + self.stall_s

    def infos(self, wait_s: float) -> list[WorkerInfo] | None:
        """Every new worker's info once all have started (waiting ``wait_s`` at most), or
        None while some are still starting. A worker lost while starting, or a start that
        stalled, kills them all and raises ``ActorDied``: none becomes a member."""
        if not self.refs:
            return []
        left = self.deadline - time.monotonic()
        ready, _ = ray.wait(self.refs, num_returns=len(self.refs), timeout=max(0.0, min(wait_s, left)))
        if fresh := [ref for ref in ready if ref not in self.got]:
            try:  # ready: the answer, or the error of a worker that died, is already here
                self.got.update(zip(fresh, ray.get(fresh, timeout=max(1.0, self.stall_s))))
            except (*ACTOR_GONE, ActorUnavailableError, GetTimeoutError) as exc:
                self._failed(exc)
            self.progress_at = time.monotonic()
        if len(self.got) == len(self.refs):
            return [self.got[ref] for ref in self.refs]
        if wait_s < left or fresh:  # (not the clock: a wait may return a hair before its timeout)
            return None  # not waited up to the deadline, or a worker answered meanwhile
        missing = [a for (_, _, a), ref in zip(self.actors, self.refs) if ref not in self.got]
        self._failed(
            GetTimeoutError(
                f"{len(missing)} of {len(self.refs)} new worker(s) did not start: none answered in "
                f"{self.stall_s:g}s (Ray: {actor_states(missing)})"
            )
        )

    def cancel(self) -> None:
        """Kill the actors (the job no longer wants them: it failed, stopped or drains first)."""
        for _, _, actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception as exc:  # noqa: BLE001 - already gone with its node
                logger.debug("kill of a new worker failed: %s", exc)

    def _failed(self, exc: BaseException) -> NoReturn:
        # A new node died (or never started its workers, or Ray killed one for memory).
        self.cancel()
        logger.warning("a new worker was lost while starting: %s", exc)
        # A stall's own message says what Ray knows; a lost worker's error is pages long.
        detail = f"{type(exc).__name__}: {exc}" if isinstance(exc, GetTimeoutError) else type(exc).__name__
        raise ActorDied(f"a new worker was lost while starting: {detail}", ranks=[], nodes=[]) from None


def actor_states(actors: list[Any], sample: int = 32) -> str:
    """What Ray's GCS says of these actors, counted by state ("3 PENDING_CREATION, 1 ALIVE"),
    of ``sample`` of them at most: one GCS read each, and only when a start has failed."""
    counts: Counter[str] = Counter()
    for actor in actors[:sample]:
        try:
            info = ray._private.state.state.actor_table(actor._actor_id.hex())
        except Exception as exc:  # noqa: BLE001 - a diagnosis only: never in the way of the failure
            return f"actor states unreadable: {type(exc).__name__}"
        counts[info.get("State") or "UNKNOWN"] += 1
    looked = "" if len(actors) <= sample else f" of {sample} looked at"
    return ", ".join(f"{n} {state}" for state, n in sorted(counts.items())) + looked
