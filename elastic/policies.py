"""Pure decision code for the elastic controller.

Policies take plain inputs (counts, the time, a snapshot of what the cluster offers) and
return decisions; they never act and do no I/O. The controller carries decisions out.
They are unit-tested without Ray.

Batch policy (documented choice): DP is restricted to degrees that divide
``global_batch / micro_batch``, as DeepSpeed's elasticity does. Every rank then gets the
same number of whole micro-batches, ``grad_accum = global_batch / (micro_batch * dp)``, and
the loss needs no per-rank weighting: the global batch and the loss scale are exact at
every DP degree.
"""

from __future__ import annotations

import enum
import math
from collections import deque
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

from elastic.errors import SpecError


class ElasticConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    min_dp: int = Field(1, ge=1)
    max_dp: int = Field(4, ge=1)
    heartbeat_timeout_s: float = Field(10.0, gt=0)
    collective_timeout_s: float = Field(30.0, gt=0)
    max_failures: int = Field(10, ge=0)
    min_dp_wait_s: float = Field(60.0, gt=0, description="how long to wait for capacity to reach min_dp")
    loss_spike_factor: float = Field(6.0, gt=0, description="spike = loss > mean + factor * std of recent steps")
    on_bad_loss: str = Field(
        "skip", pattern="^(skip|retry)$", description="after a NaN/spike: skip the batch or retry it"
    )
    grow_check_s: float = Field(1.0, gt=0, description="how often to look for returned capacity")
    # Health (docs/health.md): stragglers, lemon nodes, silent data corruption.
    straggler_factor: float = Field(1.3, gt=1, description="straggler: own compute > factor x median of its peers")
    straggler_steps: int = Field(5, ge=1, description="for this many steps in a row")
    on_straggler: str = Field("report", pattern="^(report|evict)$", description="report it, or evict its node")
    lemon_failures: int = Field(2, ge=0, description="failures or evictions that exclude a node (0: never)")
    sdc_check_every: int = Field(0, ge=0, description="compare replicas' parameter fingerprints every N steps (0: off)")
    on_sdc: str = Field(
        "repair",
        pattern="^(repair|evict)$",
        description="roll back to the last verified step; evict: also drop the odd node",
    )
    stop_grace_s: float = Field(
        30.0, gt=0, description="on SIGINT/SIGTERM: how long to wait for the step boundary before stopping at once"
    )


# --------------------------------------------------------------------------- failure policy


class FailureDecision(enum.Enum):
    RETRY = "retry"
    RAISE = "raise"


def failure_decision(failures_so_far: int, max_failures: int) -> FailureDecision:
    """Retry while the budget lasts; ``failures_so_far`` includes the one just seen."""
    return FailureDecision.RETRY if failures_so_far <= max_failures else FailureDecision.RAISE


# --------------------------------------------------------------------------- batch policy


def allowed_dps(global_batch: int, micro_batch: int, min_dp: int, max_dp: int, ep: int = 1) -> list[int]:
    """DP degrees in ``[min_dp, max_dp]`` that keep ``global_batch`` exact.

    Each replica reads ``ep`` data shards (its expert-parallel ranks train on different
    micro-batches), so the batch is split ``dp * ep`` ways.
    """
    if global_batch % micro_batch:
        return []
    micro = global_batch // micro_batch
    return [dp for dp in range(min_dp, max_dp + 1) if micro % (dp * ep) == 0]


def grad_accum(global_batch: int, micro_batch: int, dp: int, ep: int = 1) -> int:
    """Micro-batches per data shard (``dp * ep`` of them) per optimizer step; the global batch must be exact."""
    per = micro_batch * dp * ep
    if global_batch % per:
        shards = f"dp*micro_batch = {dp}*{micro_batch}" if ep == 1 else f"dp*ep*micro_batch = {dp}*{ep}*{micro_batch}"
        raise SpecError("train.global_batch", f"global_batch={global_batch} is not a multiple of {shards}")
    return global_batch // per


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


# --------------------------------------------------------------------------- loss anomalies


class LossMonitor:
    """Flags a non-finite loss, or one far above the running statistics (silent corruption)."""

    def __init__(self, spike_factor: float, window: int = 20, min_history: int = 8):
        self.spike_factor = spike_factor
        self.min_history = min_history
        self._history: deque[float] = deque(maxlen=window)

    def check(self, loss: float) -> str | None:
        if not math.isfinite(loss):
            return "nan_loss"
        if len(self._history) >= self.min_history:
            mean = sum(self._history) / len(self._history)
            var = sum((x - mean) ** 2 for x in self._history) / len(self._history)
            spread = max(math.sqrt(var), 0.02 * abs(mean))
            if loss > mean + self.spike_factor * spread:
                return "loss_spike"
        return None

    def accept(self, loss: float) -> None:
        self._history.append(loss)
