"""Terms the memory model and its extensions share (``memory_model.py``, ``memory_moe.py``):
pure, no torch."""

from __future__ import annotations

STATE_BYTES = {"adamw": 8, "adam": 8, "sgd": 4}  # optimizer state bytes per fp32 parameter


def layers_per_stage(n_layers: int, pp: int) -> list[int]:
    """Layers of each pipeline stage; the first ``n_layers % pp`` stages get one more."""
    base, extra = divmod(n_layers, pp)
    return [base + (1 if i < extra else 0) for i in range(pp)]
