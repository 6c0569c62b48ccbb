"""The models and job specs the GPU check's parts share (runs in each part's process)."""

from __future__ import annotations

import os
import tempfile
from typing import Any

# A ~210M-parameter Llama: big enough that memory is counted in GiB and a step is GPU-bound,
# small enough that building one (its weights are drawn on the host) takes about a second.
MID = dict(n_layers=12, d_model=1024, n_heads=16, n_kv_heads=8, vocab_size=32_000, multiple_of=256)
TINY = dict(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, vocab_size=256, multiple_of=16)


def device_kind(dry_run: bool) -> str:
    return "cpu" if dry_run else "cuda"


def corpus_dir() -> str:
    """Where the synthetic corpora go: one folder per part process."""
    return tempfile.mkdtemp(prefix="gpu-check-data-")


def job_dict(
    shape: dict[str, Any],
    seq_len: int,
    micro_batch: int,
    global_batch: int,
    *,
    device: str,
    recompute: bool = False,
    steps: int = 1000,
    memory_every_steps: int = 0,
    num_samples: int = 256,
    cache_dir: str | None = None,
) -> dict[str, Any]:
    """A one-rank job spec (``jobs.JobSpec`` keys) training a Llama on the synthetic corpus."""
    return {
        "name": "gpu-check",
        "seed": 0,
        "model": {"kind": "llama", **shape, "seq_len": seq_len},
        "data": {
            "source": "synthetic",
            "num_samples": num_samples,
            "loader": "native",
            "stagger_s": 0.0,
            "cache_dir": cache_dir or os.path.join(tempfile.gettempdir(), "gpu-check-data"),
        },
        "parallel": {"micro_batch": micro_batch, "activation_checkpointing": recompute},
        "elastic": {"min_dp": 1, "max_dp": 1},
        "resources": {"device": device, "gpus_per_worker": 1 if device == "cuda" else 0},
        "train": {"steps": steps, "global_batch": global_batch, "lr": 3.0e-4, "warmup_steps": 0},
        "checkpoint": {"every_steps": 0, "memory_every_steps": memory_every_steps},
    }


def job_spec(raw: dict[str, Any]) -> Any:
    from jobs import JobSpec

    return JobSpec.from_dict(raw)
