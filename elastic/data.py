"""Training data (placeholder; the streaming implementation follows)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator


class DataConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    source: str = Field("synthetic", description="'synthetic' or a parquet URI (file://, s3://, memory://)")
    num_samples: int = Field(20000, ge=1, description="corpus size for the synthetic source")
    cache_dir: str | None = Field(None, description="where the synthetic corpus is written; default <run_dir>/data")
    prefetch_steps: int = Field(2, ge=0, description="steps of batches read ahead per rank")
    stagger_s: float = Field(0.05, ge=0, description="delay between hosts' first reads")
    storage_options: dict[str, Any] = Field(default_factory=dict)

    @field_validator("source")
    @classmethod
    def _source(cls, v: str) -> str:
        if v == "synthetic" or "://" in v:
            return v
        raise ValueError("must be 'synthetic' or a URI such as file:///data/corpus or s3://bucket/corpus")
