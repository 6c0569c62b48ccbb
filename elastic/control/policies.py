"""Pure decision code for the elastic controller.

Policies take plain inputs (counts, the time, a snapshot of what the cluster offers) and
return decisions; they never act and do no I/O. The controller carries decisions out.
They are unit-tested without Ray.

The batch rule (which DP degrees keep the global batch exact) is shared with the workers
and lives in ``elastic/parallel/batch.py``; the loss-anomaly rule runs in the workers
(``elastic/worker/anomaly.py``); the controller's spec section is ``elastic/control/config.py``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

# --------------------------------------------------------------------------- failure policy


class FailureDecision(enum.Enum):
    RETRY = "retry"
    RAISE = "raise"


def failure_decision(failures_so_far: int, max_failures: int) -> FailureDecision:
    """Retry while the budget lasts; ``failures_so_far`` includes the one just seen."""
    return FailureDecision.RETRY if failures_so_far <= max_failures else FailureDecision.RAISE


# --------------------------------------------------------------------------- scaling policy


@dataclass(frozen=True)
class ResizeDecision:
    dp: int


@dataclass(frozen=True)
class NoopDecision:
    pass


def target_dp(replicas_available: int, allowed: list[int]) -> int | None:
    """Largest allowed DP that fits in the whole replicas available, or None."""
    fitting = [dp for dp in allowed if dp <= replicas_available]
    return max(fitting) if fitting else None


def scaling_decision(current_dp: int, replicas_available: int, allowed: list[int]) -> ResizeDecision | NoopDecision:
    """Grow (or shrink) to the best allowed DP the capacity supports; no-op if unchanged."""
    best = target_dp(replicas_available, allowed)
    if best is None or best == current_dp:
        return NoopDecision()
    return ResizeDecision(best)
