"""``elastic report`` on synthetic run directories: parsing, derived figures, files (no Ray)."""

from __future__ import annotations

import argparse
import json
import statistics

import pytest

from elastic.report import cli as report_cli
from elastic.report.print_report import print_report
from elastic.report.run_data import load_run, scale_factors, skipped_batches

pytestmark = pytest.mark.timeout(60)

T0 = 1_700_000_000.0


def _step(ts, step, dp, tps, loss=None):
    return {
        "ts": ts, "kind": "step", "step": step, "loss": loss if loss is not None else 5.0 - 0.1 * step, "dp": dp,
        "tp": 1, "pp": 1, "grad_accum": 12 // dp, "world_size": dp, "step_time_s": 0.2, "tokens_per_s": tps,
        "data_wait_s": 0.01, "compute_s": 0.15,
    }  # fmt: skip


def synthetic_events() -> list[dict]:
    """dp 4 for steps 1-10, a node lost, dp 3 for steps 11-20 (a NaN at step 15, batch skipped),
    dp 4 again for 21-25. Throughputs vary so the medians are not the first value."""
    ev = [{"ts": T0, "kind": "job_start", "dp": 4, "tp": 1, "pp": 1, "nodes": 4}]
    t = T0
    for s in range(1, 11):
        t += 0.2
        ev.append(_step(t, s, 4, 1000.0 + (s % 3) * 10))
        ev.append({"ts": t, "kind": "checkpoint", "step": s, "tier": "memory", "blocking_s": 0.004,
                   "duration_s": 0.01, "bytes": 100})  # fmt: skip
    ev.append({"ts": t + 0.5, "kind": "failure", "cause": "node_lost", "ranks": [2], "nodes": ["n2"], "detail": "x"})
    ev.append({"ts": t + 1.5, "kind": "resize", "old_dp": 4, "new_dp": 3, "grad_accum": 4, "reason": "node_lost"})
    ev.append({"ts": t + 1.6, "kind": "restore", "step": 10, "source": "memory", "duration_s": 0.1})
    t += 2.0
    for s in range(11, 21):
        t += 0.25
        ev.append(_step(t, s, 3, 800.0 + (s % 4) * 5))
        if s == 14:
            ev.append({"ts": t + 0.1, "kind": "failure", "cause": "nan_loss", "ranks": [0, 1, 2], "nodes": [],
                       "detail": "step 15 loss None: rolled back to step 14, skip batch 40"})  # fmt: skip
            ev.append({"ts": t + 0.1, "kind": "restore", "step": 14, "source": "memory", "duration_s": 0.0})
        if s == 20:
            ev.append({"ts": t, "kind": "checkpoint", "step": 20, "tier": "storage", "blocking_s": 0.03,
                       "duration_s": 0.5, "bytes": 1000, "committed": True})  # fmt: skip
    ev.append({"ts": t + 0.3, "kind": "resize", "old_dp": 3, "new_dp": 4, "grad_accum": 3, "reason": "capacity"})
    t += 1.0
    for s in range(21, 26):
        t += 0.2
        ev.append(_step(t, s, 4, 1020.0))
    ev.append({"ts": t + 0.01, "kind": "job_end", "status": "succeeded", "steps": 25})
    return ev


def write_run(tmp_path, events, summary=None, tail=""):
    run = tmp_path / "run"
    run.mkdir()
    with open(run / "events.jsonl", "w") as f:
        for e in events:
            f.write(json.dumps(e) + "\n")
        f.write(tail)
    if summary is not None:
        (run / "summary.json").write_text(json.dumps(summary))
    return str(run)


def test_partial_last_line_and_no_summary(tmp_path):
    ev = synthetic_events()[:-1]  # still running: no job_end
    run = write_run(tmp_path, ev, tail='{"ts": 1700000100.0, "kind": "st')
    data = load_run(run)
    assert data.skipped_lines == 1 and data.summary is None
    assert len(data.steps) == 25
    assert data.status.startswith("running")
    md = open(report_cli.write_report(run)).read()
    assert "summary.json: not written" in md and "did not parse" in md


def test_numbers_match_an_independent_computation(tmp_path):
    ev = synthetic_events()
    summary = {
        "recoveries": [
            {"cause": "node_lost", "downtime_s": 2.05, "breakdown": {"detect_s": 0.5, "rendezvous_s": 1.25}},
            {"cause": "nan_loss", "downtime_s": 0.0},
        ]
    }
    run = write_run(tmp_path, ev, summary)
    data = load_run(run)
    steps = [e for e in ev if e["kind"] == "step"]
    # Scale factor, by hand: medians at dp 3 and dp 4, per-replica throughput at dp 3.
    med = {dp: statistics.median(e["tokens_per_s"] for e in steps if e["dp"] == dp) for dp in (3, 4)}
    want = {3: 1.0, 4: med[4] / (4 * med[3] / 3)}
    got = scale_factors(data.steps)
    assert got.keys() == want.keys() and all(abs(got[n] - want[n]) < 1e-12 for n in want)
    # The pause around the node loss: from step 10's end to step 11's end.
    ts = {e["step"]: e["ts"] for e in steps}
    node_lost, nan = data.failures
    assert node_lost.cause == "node_lost" and abs(node_lost.gap_s - (ts[11] - ts[10])) < 1e-9
    assert node_lost.downtime_s == 2.05 and node_lost.step == 10.5
    assert nan.cause == "nan_loss" and nan.step == 15 and nan.gap_s is None
    assert skipped_batches(data.events) == [(15, 40)]
    assert [p.cause for p in data.pauses] == ["node_lost", "resize"]
    assert abs(data.pauses[1].gap_s - (ts[21] - ts[20])) < 1e-9
    assert [dp for _, dp in data.dp_timeline()] == [4, 3, 4]
    md = open(report_cli.write_report(run)).read()
    assert f"| 4 | {med[4]:,.0f} | 15 | {want[4]:.3f} |" in md
    assert f"| node_lost | [2] | {ts[11] - ts[10]:.2f} | 2.05 |" in md
    assert "DP over the run: 4 -> 3 -> 4" in md
    assert "Recovery 1 (node_lost), where its time went (s, summary.json): detect_s 0.500, rendezvous_s 1.250" in md


def test_figures_are_written_and_not_blank(tmp_path):
    import matplotlib.image

    run = write_run(tmp_path, synthetic_events())
    out = tmp_path / "out"
    args = argparse.Namespace(run_dir=run, out=str(out))
    assert report_cli.main(args) == 0
    md = (out / "report.md").read_text()
    for name in ("loss.png", "throughput.png", "timeline.png", "step_breakdown.png"):
        assert f"]({name})" in md
        img = matplotlib.image.imread(str(out / name))
        assert img.shape[0] >= 400 and img.shape[1] >= 800
        # Non-trivial: many distinct colours (lines, text, bands), not a blank canvas.
        colours = {tuple(px) for px in img.reshape(-1, img.shape[-1])[::7].round(2).tolist()}
        assert len(colours) > 50, name


def test_single_dp_run_has_no_scale_factor(tmp_path):
    ev = [e for e in synthetic_events() if e["kind"] != "step" or e["dp"] == 4]
    data = load_run(write_run(tmp_path, ev))
    assert scale_factors(data.steps) == {}


def test_bad_run_dir_exits_2_naming_the_field(tmp_path, capsys):
    assert report_cli.main(argparse.Namespace(run_dir=str(tmp_path / "nope"), out=None)) == 2
    assert capsys.readouterr().err.startswith("error: RUN_DIR:")
    assert report_cli.main(argparse.Namespace(run_dir=str(tmp_path), out=None)) == 2


def test_report_at_the_end_of_a_run_never_raises(tmp_path, capsys):
    assert print_report(str(tmp_path / "missing")) is None
    assert "report: not written" in capsys.readouterr().err
    assert print_report(write_run(tmp_path, synthetic_events())).endswith("report.md")


def test_a_long_run_is_binned(tmp_path):
    """More steps than bars: the breakdown shows bin means, and the figures stay quick."""
    import time

    ev = [{"ts": T0, "kind": "job_start", "dp": 2, "tp": 1, "pp": 1, "nodes": 2}]
    ev += [_step(T0 + 0.1 * s, s, 2, 500.0) for s in range(1, 1201)]
    run = write_run(tmp_path, ev)
    t = time.perf_counter()
    md = open(report_cli.write_report(run)).read()
    print(f"1200 steps: report in {time.perf_counter() - t:.2f}s")
    assert "steps completed: 1200" in md and "scale factor" not in md
