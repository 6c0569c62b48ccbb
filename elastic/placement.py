"""Where workers run: resources per worker and Ray placement groups."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class ResourcesConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    device: Literal["cpu", "cuda"] = "cpu"
    cpus_per_worker: float = Field(1, ge=0)
    gpus_per_worker: float = Field(0, ge=0)
    custom: dict[str, float] = Field(default_factory=dict, description="extra Ray resources per worker")
