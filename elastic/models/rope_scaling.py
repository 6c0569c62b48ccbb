"""``model.rope_scaling``: Llama 3.1's RoPE frequency scaling, a pydantic section of the spec
(torch-free). Its own module because both the spec's model section (``config.py``) and the
Hugging Face mapping (``hf.py``, which ``config.py`` calls) build it."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from elastic.errors import SpecError


class RopeScaling(BaseModel):
    """Llama 3.1's RoPE frequency scaling (``rope_type: llama3`` in Hugging Face configs)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["llama3"] = "llama3"
    factor: float = Field(..., ge=1, description="long wavelengths are divided by this")
    low_freq_factor: float = Field(..., gt=0)
    high_freq_factor: float = Field(..., gt=0)
    original_max_position_embeddings: int = Field(..., ge=1, description="the pre-training context length")

    def check(self) -> None:
        if self.high_freq_factor <= self.low_freq_factor:
            raise SpecError(
                "model.rope_scaling.high_freq_factor",
                f"{self.high_freq_factor:g} must be larger than model.rope_scaling.low_freq_factor "
                f"({self.low_freq_factor:g})",
            )
