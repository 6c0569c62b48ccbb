"""The recovery benchmark's scenario, shared by every side: the cluster shape, the model, the
job, and each baseline's settings. Imported by the driver and by every side's child process
(and by ``benchmarks/reconfigure_profile.py``, which profiles the same model).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from typing import Any

from benchmarks.harness.results import results_path
from benchmarks.harness.stats import median_interval

# ``--nodes 3`` (one worker each) fits the 100m size's state and snapshots in a 24 GB host;
# the choice reaches every side's child process through BENCH_RECOVERY_NODES.
NODES_ENV = "BENCH_RECOVERY_NODES"
NODES = int(os.environ.get(NODES_ENV, "4"))
GLOBAL_BATCH = 12  # divisible by every DP degree from 1 to 4
# The largest micro-batch that divides every rank's share at every DP degree the job can take
# (1 to NODES), as a user would pick it: 1 at 4 nodes (shares 12, 6, 4, 3), 2 at 3 nodes. The
# TorchFT sides run their replica's rows in one forward.
MICRO_BATCH = math.gcd(*(GLOBAL_BATCH // d for d in range(1, NODES + 1)))
# ``--model small`` (the default): 4,207,104 parameters, 16.8 MB of fp32 weights + 33.7 MB of
# AdamW moments = 50.5 MB of state. ``--model 10m``: 11,162,240 parameters (134 MB of state).
# ``--model 100m``: 102,305,280 parameters (1.23 GB of state).
# The choice reaches every side's child process through BENCH_RECOVERY_MODEL.
MODELS = {
    "small": {"n_layers": 4, "d_model": 256, "n_heads": 4, "vocab_size": 2048, "seq_len": 32},
    "10m": {"n_layers": 8, "d_model": 320, "n_heads": 5, "vocab_size": 2048, "seq_len": 32},
    "100m": {"n_layers": 14, "d_model": 768, "n_heads": 12, "vocab_size": 2048, "seq_len": 32},
}
MODEL_ENV = "BENCH_RECOVERY_MODEL"
MODEL = MODELS[os.environ.get(MODEL_ENV, "small")]
SIDES = ("ours", "raytrain_tuned", "raytrain_default", "torchft", "raytrain_torchft")
TORCHFT_SIDES = ("torchft", "raytrain_torchft")
REJOIN_SIDES = ("ours", "torchft", "raytrain_torchft")  # a node comes back after the loss
RAY_TUNED_ENV = {"RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "5", "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.2"}
RAY_TUNED_SYSTEM_CONFIG = {"health_check_period_ms": 500, "health_check_failure_threshold": 3}
TORCHFT_HEARTBEAT_TIMEOUT_MS = 1000
TORCHFT_JOIN_TIMEOUT_MS = 10000
RTFT_NODE_RESOURCE = "bench_worker_node"  # raytrain_torchft: keeps its workers off the head
DEFAULT_RESULTS = results_path("recovery.json")


def param_count(m: dict[str, Any]) -> int:
    from elastic.models.gpt import ModelConfig, build_model

    return sum(p.numel() for p in build_model(ModelConfig(**m), seed=0).parameters())


def spec_dict(steps: int, corpus_uri: str) -> dict[str, Any]:
    """The job every side trains (Ray Train and TorchFT read the model/optimizer/data fields)."""
    return {
        "name": "recovery-bench",
        "seed": 0,
        "model": dict(MODEL),
        "data": {"source": corpus_uri},
        "parallel": {"micro_batch": MICRO_BATCH},
        "elastic": {"min_dp": 1, "max_dp": NODES},
        "resources": {"cpus_per_worker": 1},
        "train": {"steps": steps, "global_batch": GLOBAL_BATCH, "lr": 3.0e-3},
        "checkpoint": {"every_steps": 5, "memory_every_steps": 1},
    }


def first_step_work(
    recovery_s: float, completions: Iterable[tuple[int, float]], rows_per_worker: int
) -> dict[str, Any]:
    """What the first step at the smaller size weighs in a side's ``recovery_s``: the rows
    each worker trains in a step there (ours and Ray Train keep the global batch, so a
    survivor trains more; TorchFT's replicas keep their share, so the global batch shrinks),
    the steady step there (median interval between the completions ``done_ts`` of that
    size's steps, the first included), and the recovery less that step."""
    out: dict[str, Any] = {"rows_per_worker_at_new_size": rows_per_worker}
    done: dict[int, float] = {}
    for step, ts in completions:
        done[step] = max(done.get(step, ts), ts)
    step_s = median_interval(done.values())
    if step_s is not None:
        out["steady_step_at_new_size_s"] = step_s
        out["recovery_less_step_s"] = recovery_s - step_s
    return out
