"""``HFAdapter``: how a model maps to a Hugging Face model directory (``ModelSpec.hf``).

Pure data, no torch: the driver reads it while it checks a spec. ``elastic/models/hf.py``
builds the built-in Llama's and reads directories; ``elastic/checkpoint/hf_import.py`` and
``export.py`` load and write weights through it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class HFAdapter:
    """How a model maps to a Hugging Face model directory."""

    config: dict[str, Any]  # the config.json an export writes (without the dtype)
    names: dict[str, str]  # project FQN -> Hugging Face tensor name (tied FQNs share one)
    rotary: dict[str, int] = field(default_factory=dict)  # FQN -> head dim, rows permuted per head
    optional: frozenset[str] = frozenset()  # Hugging Face names a directory may hold and nobody reads
    # FQN of an [E, in, out] expert tensor -> the E Hugging Face [out, in] linears it stacks
    experts: dict[str, tuple[str, ...]] = field(default_factory=dict)
