"""Configuration of the parallel layout (spec key ``parallel``)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class ParallelConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tp: int = Field(1, ge=1, description="tensor-parallel degree (inside a node)")
    pp: int = Field(1, ge=1, description="pipeline-parallel degree (stages per replica)")
    ep: int = Field(1, ge=1, description="expert-parallel degree: experts sharded over this many ranks (model.moe)")
    cp: int = Field(1, ge=1, description="context-parallel degree: each sequence split over this many ranks")
    zero: int = Field(0, ge=0, le=3, description="0 = DDP; 1, 2, 3 = FSDP2 sharding levels")
    micro_batch: int = Field(4, ge=1, description="samples per micro-batch per DP rank")
    activation_checkpointing: bool = False
    pp_schedule: str = Field("1f1b", pattern="^(1f1b|gpipe)$")

    @property
    def replica_size(self) -> int:
        """Workers in one model replica: the unit in which DP grows and shrinks."""
        return self.tp * self.pp * self.ep * self.cp
