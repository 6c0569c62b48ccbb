"""Configuration of checkpointing (spec key ``checkpoint``)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator


class CheckpointConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    uri: str | None = Field(None, description="default: <run_dir>/checkpoints")
    every_steps: int = Field(20, ge=0, description="storage-tier period in steps; 0 disables")
    memory_every_steps: int = Field(1, ge=0, description="memory-tier period in steps; 0 disables")
    async_: bool = Field(True, alias="async", description="upload in the background")
    keep: int = Field(3, ge=1, description="committed checkpoints kept in storage")
    replicate: bool = Field(
        True,
        description="also copy each memory snapshot to a peer on another node when no other node holds that state "
        "(FSDP shards, TP/PP without a DP twin): a lost node's shards then come back from peer memory, not storage",
    )
    storage_options: dict[str, Any] = Field(
        default_factory=dict, description="fsspec options (e.g. S3 endpoint_url, key, secret)"
    )

    @field_validator("uri")
    @classmethod
    def _shared_storage(cls, value: str | None) -> str | None:
        if value is not None and value.lower().startswith("memory://"):  # it trained, then failed at the end
            raise ValueError(
                "memory:// lives in one process: the ranks write there and the driver commits elsewhere; "
                "use a path, file:// or s3://"
            )
        return value
