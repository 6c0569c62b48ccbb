"""What a run prints about recoveries: its own measured fields by their contract names, and
benchmark figures only as quoted from the benchmark's results file, named and dated."""

from __future__ import annotations

import json

import pytest

from elastic.events import Recovery, RunResult
from elastic.progress import format_summary
from jobs.demo import benchmark_comparison

pytestmark = pytest.mark.timeout(30)


def test_summary_prints_the_recovery_fields_by_name():
    rec = Recovery(cause="node_lost", detect_s=0.41, recover_s=0.83, downtime_s=1.24, lost_steps=0)
    result = RunResult(
        status="succeeded",
        steps=10,
        final_loss=1.0,
        wall_s=5.0,
        mean_tokens_per_s=100.0,
        failures=1,
        dp_history=[[0, 4], [3, 3]],
        recoveries=[rec],
    )
    text = format_summary(result, "/tmp/run")
    assert "node_lost: downtime_s 1.24 (detect_s 0.41 + recover_s 0.83), lost_steps 0" in text
    assert "where it went" not in text  # no breakdown recorded: none printed


def test_summary_prints_the_breakdown_in_phase_order():
    breakdown = {"detect_s": 0.05, "decide_s": 0.01, "free_s": 0.02, "rendezvous_s": 0.1, "first_step_s": 0.3}
    rec = Recovery(cause="node_lost", detect_s=0.05, recover_s=0.43, downtime_s=0.48, lost_steps=0, breakdown=breakdown)
    result = RunResult(
        status="succeeded", steps=10, final_loss=1.0, wall_s=5.0, mean_tokens_per_s=1.0, failures=1, recoveries=[rec]
    )
    text = format_summary(result, "/tmp/run")
    assert "where it went: detect_s 0.050, decide_s 0.010, free_s 0.020, rendezvous_s 0.100, first_step_s 0.300" in text


def test_no_results_file_prints_no_comparison(tmp_path):
    assert benchmark_comparison(str(tmp_path / "missing.json")) is None
    (tmp_path / "bad.json").write_text("{not json")
    assert benchmark_comparison(str(tmp_path / "bad.json")) is None


def test_comparison_quotes_the_results_file_with_its_date(tmp_path):
    path = tmp_path / "recovery.json"
    summary = {
        "ours": {
            "recovery_s": {"median": 2.04, "min": 1.9, "max": 2.5, "n": 3},
            "lost_steps": {"median": 0, "min": 0, "max": 0, "n": 3},
        },
        "raytrain_tuned": {
            "recovery_s": {"median": 26.3, "min": 25.0, "max": 27.0, "n": 3},
            "lost_steps": {"median": 1, "min": 1, "max": 1, "n": 3},
        },
        "torchft": {"recovery_s": None, "lost_steps": None, "skipped": "not importable"},
    }
    path.write_text(json.dumps({"date_utc": "2026-11-23T09:00:00Z", "summary": summary}))
    line = benchmark_comparison(str(path))
    assert "recovery.json (measured 2026-11-23T09:00:00Z; medians" in line
    assert "this runtime 2.04 s (range 1.90-2.50) and 0 step(s) lost (n=3)" in line
    assert "Ray Train V2 (tuned) 26.30 s (range 25.00-27.00) and 1 step(s) lost (n=3)" in line
    assert "TorchFT" not in line and "not measured by this run" in line
