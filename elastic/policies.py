"""Pure decision code for the elastic controller (placeholder: filled in by the controller work)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class ElasticConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    min_dp: int = Field(1, ge=1)
    max_dp: int = Field(4, ge=1)
    heartbeat_timeout_s: float = Field(10.0, gt=0)
    collective_timeout_s: float = Field(30.0, gt=0)
    max_failures: int = Field(10, ge=0)
    min_dp_wait_s: float = Field(60.0, gt=0, description="how long to wait for capacity to reach min_dp")
    loss_spike_factor: float = Field(6.0, gt=0, description="spike = loss > mean + factor*std of recent steps")
    on_bad_loss: str = Field("skip", pattern="^(skip|retry)$", description="skip the batch or retry it")
