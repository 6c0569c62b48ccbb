"""Helpers of the checkpoint tests: tiny job specs and event queries."""

from __future__ import annotations

import copy
import os
from typing import Any

import pytest

from elastic.events import read_events
from jobs import JobSpec


def ckpt_raw(tiny: dict, uri: str, **sections: dict) -> dict:
    """``tiny_spec_dict`` with a storage tier at ``uri``; ``sections`` update its sections.

    The LR schedule does not depend on ``train.steps`` (warmup over 8 steps, then constant),
    so a run extended with ``--resume`` can be compared with one that ran all steps.
    """
    raw = copy.deepcopy(tiny)
    raw["train"].update({"warmup_steps": 8, "min_lr_ratio": 1.0})
    raw["checkpoint"] = {"uri": uri, "every_steps": 3, "keep": 10}
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    return raw


def ckpt_spec(tiny: dict, uri: str, **sections: dict) -> JobSpec:
    return JobSpec.from_dict(ckpt_raw(tiny, uri, **sections))


def events(run_dir: str, kind: str, **match: Any) -> list[dict]:
    return [e for e in read_events(run_dir) if e["kind"] == kind and all(e.get(k) == v for k, v in match.items())]


def losses(run_dir: str) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in events(run_dir, "step")}


def metrics(run_dir: str) -> dict[int, tuple[float, float]]:
    """(loss, pre-clip global grad norm) per step."""
    return {e["step"]: (e["loss"], e["grad_norm"]) for e in events(run_dir, "step")}


def assert_same_metrics(
    got: dict[int, tuple[float, float]], want: dict[int, tuple[float, float]], steps, rel: float = 1e-5
) -> None:
    """Loss and grad norm of every step in ``steps`` within ``rel`` of the reference's; prints the worst."""
    worst = max(abs(g - w) / abs(w) for s in steps for g, w in zip(got[s], want[s]))
    print(f"max relative difference to the fault-free run: {worst:.2e} (tolerance {rel:g})")
    for s in steps:
        assert got[s][0] == pytest.approx(want[s][0], rel=rel), f"step {s}: loss {got[s][0]} vs {want[s][0]}"
        assert got[s][1] == pytest.approx(want[s][1], rel=rel), f"step {s}: grad norm {got[s][1]} vs {want[s][1]}"


_DP1: dict[str, dict[int, tuple[float, float]]] = {}


def dp1_reference(tiny: dict, steps: int, cache_dir: str, **sections: dict) -> dict[int, tuple[float, float]]:
    """(loss, grad norm) per step of the fault-free ``ckpt_spec(tiny, ...)`` run of ``steps``
    steps (``sections`` update it), trained by one rank in the test's process
    (``single_rank_metrics``: the worker's own ``Trainer`` and samples at dp 1), not a Ray
    run; once per session for each spec."""
    import json

    from elastic_testlib import single_rank_metrics

    spec = ckpt_spec(tiny, os.path.join(cache_dir, "unused"), **{"train": {"steps": steps}, **sections})
    key = json.dumps(spec.model_dump(mode="json", exclude={"checkpoint": {"uri"}}), sort_keys=True)
    if key not in _DP1:
        _DP1[key] = single_rank_metrics(spec, cache_dir)
    assert sorted(_DP1[key]) == list(range(1, steps + 1))
    return _DP1[key]
