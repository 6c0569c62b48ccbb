"""``LoopRunFiles`` (no cluster): a loop run's throughput is the rows the platform's loaders
served, measured per step; a figure it did not measure (tokens) is null in summary.json."""

from __future__ import annotations

import json

import pytest

from elastic.events import read_events
from elastic.train.loop_messages import LoopReport
from elastic.train.run_files import LoopRunFiles


def _rep(ts: float, rows: int | None, loss: float = 1.0) -> LoopReport:
    return LoopReport(index=1, rank=0, generation=1, world=2, metrics={"loss": loss}, ts=ts, rows_served=rows)


def test_rows_per_s_is_what_the_loaders_served_over_the_step_time(tmp_path):
    files = LoopRunFiles(str(tmp_path))
    files.started(2, 2)
    files.entered(1, 0, 2, None)
    start = files._generation_start[1][0]
    files.step(1, 2, {0: _rep(start + 0.5, 8), 1: _rep(start + 0.4, 8)})  # 16 rows in 0.5 s
    files.step(2, 2, {0: _rep(start + 0.75, 8), 1: _rep(start + 0.7, 6)})  # 14 rows in 0.25 s
    files.end("succeeded", 2, 1.0)
    files.close()
    steps = [e for e in read_events(str(tmp_path)) if e["kind"] == "step"]
    assert [s["rows_per_s"] for s in steps] == pytest.approx([32.0, 56.0], rel=1e-9)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["mean_rows_per_s"] == pytest.approx(44.0, rel=1e-9)
    assert summary["mean_tokens_per_s"] is None  # not measured: never printed as a figure


def test_a_loop_with_its_own_loader_has_no_throughput_figure(tmp_path):
    files = LoopRunFiles(str(tmp_path))
    files.started(1, 1)
    files.entered(1, 0, 1, None)
    start = files._generation_start[1][0]
    files.step(1, 1, {0: _rep(start + 0.5, None)})  # no loader of the platform's
    files.step(2, 1, {0: _rep(start + 0.9, 0)})  # a dataset shard the loop never read
    files.end("succeeded", 2, 1.0)
    files.close()
    assert all("rows_per_s" not in e for e in read_events(str(tmp_path)) if e["kind"] == "step")
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert "mean_rows_per_s" not in summary and summary["mean_tokens_per_s"] is None


def test_ray_live_metrics_take_a_loop_runs_events(tmp_path):
    """``RunMetrics`` (the ``elastic_*`` metrics, docs/observability.md) hears a loop run's
    events as ``LoopDriver`` subscribes it: steps without ``tokens_per_s`` do not disable it."""
    from elastic.report.metrics import RunMetrics

    files = LoopRunFiles(str(tmp_path))
    live = RunMetrics("loop-run", recoveries=lambda: files.recoveries)
    files.subscribe(live)
    files.started(2, 2)
    files.entered(1, 0, 2, None)
    start = files._generation_start[1][0]
    files.step(1, 2, {0: _rep(start + 0.5, 8), 1: _rep(start + 0.4, 8)})
    files.step(2, 2, {0: _rep(start + 0.9, None), 1: _rep(start + 0.8, None)})
    files.failure("actor_died", [1], ["n1"], "lost", 0.0, 0.1)
    files.end("failed", 2, 1.0, "lost")
    files.close()
    assert live._failed is False
