"""The simulator's control-plane costs come from the benchmark's results file: a power law
through its two largest runs, at least linear beyond them for the decision, the file named
and dated in the source (pure, no Ray)."""

from __future__ import annotations

import json

import pytest

from elastic.simulator.control_plane import load_control_plane

pytestmark = pytest.mark.timeout(30)


def _run(ranks: int, decision_s: float, detect_s: float) -> dict:
    host = {"cpus": 2, "loadavg_start": [1.5, 1.0, 1.0]}
    return {"ranks": ranks, "recovery_decision_s": decision_s, "detect_s": detect_s, "host": host}


def test_costs_follow_a_power_law_through_the_largest_runs(tmp_path):
    path = tmp_path / "control_plane.json"
    runs = {"64": _run(64, 9.0, 9.0), "1024": _run(1024, 0.1, 0.5), "4096": _run(4096, 0.4, 0.5)}
    path.write_text(json.dumps({"date_utc": "2026-11-26T03:00:00Z", "runs": runs}))
    cp = load_control_plane(path)
    assert cp is not None
    assert cp.decision_s(4096) == pytest.approx(0.4)
    assert cp.decision_s(16384) == pytest.approx(1.6)  # linear through (1024, 0.1) and (4096, 0.4)
    assert cp.detect_s(16384) == pytest.approx(0.5)
    assert "2026-11-26T03:00:00Z" in cp.source and "load 1.5" in cp.source
    assert "(extrapolated)" in cp.describe(16384) and "(extrapolated)" not in cp.describe(2048)


def test_beyond_the_largest_run_the_decision_grows_at_least_linearly(tmp_path):
    path = tmp_path / "control_plane.json"
    # The largest run's decision below the one before it (that one on a busier machine).
    runs = {"4096": _run(4096, 0.8, 0.5), "16384": _run(16384, 0.6, 0.4)}
    path.write_text(json.dumps({"date_utc": "2026-11-27T05:00:00Z", "runs": runs}))
    cp = load_control_plane(path)
    assert cp is not None
    assert cp.decision_s(16384) == pytest.approx(0.6)
    assert cp.decision_s(100_000) == pytest.approx(0.6 * 100_000 / 16384)  # linear, not falling
    assert cp.detect_s(100_000) == pytest.approx(0.4)  # flat, not falling
    assert cp.decision_s(8192) == pytest.approx((0.6 * 0.8) ** 0.5)  # inside the measured range: through both points


def test_no_results_file_or_no_recovery_means_not_measured(tmp_path):
    assert load_control_plane(tmp_path / "absent.json") is None
    path = tmp_path / "control_plane.json"
    path.write_text(json.dumps({"date_utc": "x", "runs": {"64": {"ranks": 64, "host": {}}}}))
    assert load_control_plane(path) is None
