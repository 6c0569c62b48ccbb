"""Helpers of the elastic tests: one spec, loss extraction and comparison."""

from __future__ import annotations

import copy

import pytest

from elastic.events import read_events
from jobs import JobSpec

STEPS = 32
FAULT_STEP = 8


def elastic_spec(**elastic) -> JobSpec:
    """Pure DP, tiny GPT, global batch 12 (reachable at dp 1..4), a memory snapshot every step."""
    raw = {
        "name": "elastic-test",
        "seed": 1,
        "model": {"n_layers": 2, "d_model": 32, "n_heads": 4, "vocab_size": 64, "seq_len": 16},
        "data": {"num_samples": 4000},
        "parallel": {"micro_batch": 1},
        "elastic": {"min_dp": 1, "max_dp": 4, "heartbeat_timeout_s": 4, "collective_timeout_s": 6, "max_failures": 5,
                    "on_bad_loss": "retry", "min_dp_wait_s": 20, **elastic},
        "train": {"steps": STEPS, "global_batch": 12, "lr": 3.0e-3},
        "checkpoint": {"every_steps": 0, "memory_every_steps": 1},
    }
    return JobSpec.from_dict(copy.deepcopy(raw))


def step_losses(run_dir: str) -> dict[int, float]:
    """Loss per step; a step replayed after a recovery keeps its last value."""
    return {e["step"]: e["loss"] for e in read_events(run_dir) if e["kind"] == "step"}


def events_of(run_dir: str, kind: str) -> list[dict]:
    return [e for e in read_events(run_dir) if e["kind"] == kind]


def assert_matches_reference(losses: dict[int, float], reference: dict[int, float], rel: float = 0.01) -> None:
    assert sorted(losses) == sorted(reference) == list(range(1, STEPS + 1))
    for step, loss in reference.items():
        assert losses[step] == pytest.approx(loss, rel=rel), f"step {step}: {losses[step]} vs fault-free {loss}"
