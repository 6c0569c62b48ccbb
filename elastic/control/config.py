"""The controller's section of the job spec: ``elastic.*`` (``docs/spec.md``)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class ElasticConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    min_dp: int = Field(1, ge=1)
    max_dp: int = Field(4, ge=1)
    heartbeat_timeout_s: float = Field(10.0, gt=0)
    collective_timeout_s: float = Field(
        30.0, ge=1, description="at least 1 s: a group's ranks cannot even connect in less (0.001 failed every start)"
    )
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
