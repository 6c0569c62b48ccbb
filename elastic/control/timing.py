"""Where a recovery's time goes: the breakdown in the ``restore`` event and in
``summary.json`` ``recoveries`` (``docs/outputs.md``).

Every phase is timed on the driver's monotonic clock, except the three inside the
workers' ``reconfigure`` (rendezvous, rebuild, restore), which each rank times itself; the
slowest rank's time is the one that holds the group up. What the driver waited for beyond
those three (RPC round trips, leaving the old group, opening the data stream) is
``configure_other_s``. The phases add up to the recovery's ``downtime_s`` (to within the
rounding and the gap between the slowest ranks of two phases).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from elastic.control.worker_group.api import ConfigureResult

# In the order they happen; ``first_step_s`` is known only once the first step at the new
# size is done, so the ``restore`` event (written before it) lacks it.
PHASES = (
    "detect_s",  # the failure -> its diagnosis
    "decide_s",  # the diagnosis -> a plan: budget, capacity, the newest covering snapshot
    "free_s",  # kill the culprits, wait for the survivors to leave run() and collect their steps
    "spawn_s",  # start replacement workers (0 when the job only shrinks)
    "rendezvous_s",  # join the new generation of the process group and its mesh sub-groups
    "rebuild_s",  # rebuild the model engine: parallel wrappers, optimizer
    "restore_s",  # load the state (memory snapshots or storage)
    "configure_other_s",  # configure's RPCs, leaving the old group, opening the data stream
    "first_step_s",  # configured -> the first step at the new size done by every rank
)


class PhaseTimer:
    """Charges the time since the last mark to a named phase."""

    def __init__(self, clock: Callable[[], float], start: float, detect_s: float = 0.0):
        self.clock = clock
        self.last = start
        self.phases: dict[str, float] = {"detect_s": max(0.0, detect_s)}

    def mark(self, phase: str) -> float:
        now = self.clock()
        self.phases[phase] = self.phases.get(phase, 0.0) + max(0.0, now - self.last)
        self.last = now
        return now

    def configured(self, result: ConfigureResult) -> float:
        """Charge a ``reform`` call (just returned) to the three worker phases and the rest."""
        now = self.clock()
        wall = max(0.0, now - self.last)
        inside = {"rendezvous_s": result.init_s, "rebuild_s": result.build_s, "restore_s": result.restore_s}
        for k, v in inside.items():
            self.phases[k] = self.phases.get(k, 0.0) + v
        self.phases["configure_other_s"] = self.phases.get("configure_other_s", 0.0) + max(
            0.0, wall - sum(inside.values())
        )
        self.last = now
        return now

    def rounded(self) -> dict[str, float]:
        return {k: round(self.phases[k], 3) for k in PHASES if k in self.phases}
