"""End-to-end runs on a real local Ray: CLI, ``python -m jobs.train``, Python API, DP equivalence."""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import time

import pytest
import yaml
from elastic_testlib import single_rank_metrics

from elastic import ElasticTrainer
from elastic.events import read_events
from jobs import JobSpec

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]


def _write_spec(tmp_path, raw) -> str:
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def _losses(run_dir: str) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in read_events(run_dir) if e["kind"] == "step"}


def test_dp2_matches_dp1_per_step(ray_local, tiny_spec_dict, tmp_path):
    """Same seed, data and global batch: DP changes neither the samples nor the loss scale.
    dp 1 is the worker's own ``Trainer`` as one rank in this process (``single_rank_metrics``),
    dp 2 a run on Ray."""
    raw = dict(tiny_spec_dict, elastic=dict(tiny_spec_dict["elastic"], min_dp=2, max_dp=2))
    trainer = ElasticTrainer(JobSpec.from_dict(raw), run_dir=str(tmp_path / "dp2"))
    result = trainer.fit()
    assert result.status == "succeeded" and result.steps == 8
    assert result.dp_history == [[0, 2]]
    dp1 = single_rank_metrics(JobSpec.from_dict(tiny_spec_dict), str(tmp_path / "dp1-data"))
    runs = {1: {step: loss for step, (loss, _) in dp1.items()}, 2: _losses(trainer.run_dir)}
    assert sorted(runs[1]) == list(range(1, 9))
    for step, loss in runs[1].items():
        assert runs[2][step] == pytest.approx(loss, rel=1e-5), step
    assert runs[1][8] < runs[1][1]


def _eval_corpus(path, rows: int, width: int, vocab: int) -> str:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    tokens = np.random.default_rng(2).integers(0, vocab, rows * width).astype(np.int32)
    path.mkdir()
    pq.write_table(pa.table({"tokens": pa.FixedSizeListArray.from_arrays(pa.array(tokens), width)}), path / "e.parquet")
    return str(path)


def test_elastic_run_cli_writes_contract_artefacts(ray_local, tiny_spec_dict, tmp_path):
    """The run files of the contract, the progress display, and an eval every 3 steps
    (``data.eval_source``) in events.jsonl, the progress lines and TensorBoard."""
    config = _write_spec(tmp_path, tiny_spec_dict)
    run_dir = tmp_path / "run"
    m = tiny_spec_dict["model"]
    eval_source = _eval_corpus(tmp_path / "eval", 11, m["seq_len"] + 1, m["vocab_size"])
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "jobs.cli",
            "run",
            config,
            "--run-dir",
            str(run_dir),
            "--set",
            "train.steps=6",
            "--set",
            f"data.eval_source={eval_source}",
            "--set",
            "train.eval_every=3",
            "--set",
            "train.tensorboard=true",
            "--address",
            ray_local.get_runtime_context().gcs_address,
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    events = read_events(str(run_dir))
    kinds = [e["kind"] for e in events]
    assert kinds[0] == "job_start" and kinds[-1] == "job_end"
    assert all("ts" in e for e in events)
    start = events[0]
    assert {"dp", "tp", "pp", "nodes"} <= set(start)
    steps = [e for e in events if e["kind"] == "step"]
    assert [e["step"] for e in steps] == list(range(1, 7))
    required = {"step", "loss", "dp", "tp", "pp", "grad_accum", "world_size", "step_time_s", "tokens_per_s"}
    assert all(required <= set(e) for e in steps)
    assert steps[0]["grad_accum"] * steps[0]["dp"] * 2 == 8  # global = dp * micro * accum
    summary = json.load(open(run_dir / "summary.json"))
    contract = {"status", "steps", "final_loss", "wall_s", "mean_tokens_per_s", "failures", "dp_history", "recoveries"}
    # docs/outputs.md: `excluded_nodes` (lemon nodes) and `checkpoint_failures` are always
    # written, `stop` only after a stop
    assert set(summary) == contract | {"excluded_nodes", "checkpoint_failures"}
    assert summary["excluded_nodes"] == [] and summary["checkpoint_failures"] == []
    assert summary["status"] == "succeeded" and summary["steps"] == 6
    assert summary["final_loss"] == pytest.approx(steps[-1]["loss"])
    assert "step" in proc.stdout and "loss" in proc.stdout  # progress display
    evals = [e for e in events if e["kind"] == "eval"]
    assert [e["step"] for e in evals] == [3, 6] and all(e["rows"] == 11 for e in evals)
    assert all(0 < e["eval_loss"] < 10 for e in evals)
    for e in evals:
        assert f"eval  step {e['step']:>5}/6  eval_loss {e['eval_loss']:.4f}" in proc.stdout
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    got = [(s.step, s.value) for s in acc.Scalars("eval/loss")]
    assert got == [(e["step"], pytest.approx(e["eval_loss"], rel=1e-6)) for e in evals]


def test_jobs_train_entry_point(ray_local, tiny_spec_dict, tmp_path):
    """What `ray job submit -- python -m jobs.train CONFIG` runs inside the job."""
    config = _write_spec(tmp_path, tiny_spec_dict)
    env = dict(os.environ, RAY_ADDRESS=ray_local.get_runtime_context().gcs_address)
    proc = subprocess.run(
        [sys.executable, "-m", "jobs.train", config, "--run-dir", str(tmp_path / "job"), "--set", "train.steps=3"],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.load(open(tmp_path / "job" / "summary.json"))
    assert summary["steps"] == 3 and summary["status"] == "succeeded"
    bad = subprocess.run(
        [sys.executable, "-m", "jobs.train", config, "--set", "parallel.tp=3"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "parallel.tp" in bad.stderr


def test_ray_data_loader_streams_the_same_samples(ray_local, tiny_spec_dict, tmp_path):
    """`data.loader: ray_data` feeds each DP rank from a Ray Data pipeline in the same order."""
    losses = {}
    for loader in ("native", "ray_data"):
        raw = dict(tiny_spec_dict, elastic=dict(tiny_spec_dict["elastic"], min_dp=2, max_dp=2))
        raw["data"] = dict(raw["data"], loader=loader)
        raw["train"] = dict(raw["train"], steps=5)
        trainer = ElasticTrainer(JobSpec.from_dict(raw), run_dir=str(tmp_path / loader))
        assert trainer.fit().status == "succeeded"
        losses[loader] = _losses(trainer.run_dir)
    assert sorted(losses["ray_data"]) == [1, 2, 3, 4, 5]
    for step, loss in losses["native"].items():
        assert losses["ray_data"][step] == pytest.approx(loss, rel=1e-6), step


def _run_until_steps(config, run_dir, gcs_address, steps_seen: int) -> subprocess.Popen:
    """``elastic run`` of 400 steps as a subprocess, returned once ``steps_seen`` steps are in its events."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "jobs.cli", "run", config, "--run-dir", str(run_dir)]
        + ["--set", "train.steps=400", "--set", "elastic.max_dp=1", "--address", gcs_address],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    events = run_dir / "events.jsonl"
    deadline = time.monotonic() + 120
    while not (events.exists() and events.read_text().count('"kind": "step"') >= steps_seen):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate(timeout=60)
        time.sleep(0.05)
    return proc


def test_a_killed_gcs_ends_the_job_failed_at_once_with_its_end_written(tiny_spec_dict, tmp_path):
    """Issue 48, L21: the GCS of the run's own embedded Ray (its own, not the shared
    ``ray_local``: it is killed) is SIGKILLed mid-run. Training goes on without it (gloo),
    but the next drain poll waited for it until Ray ended the driver 60 s later, exit 1,
    without ``job_end`` or ``summary.json``. Now the job fails within a poll, one line naming
    the GCS, its end and summary written, and the CLI exits by itself, before Ray would."""
    import psutil

    config = _write_spec(tmp_path, dict(tiny_spec_dict, elastic=dict(tiny_spec_dict["elastic"], max_dp=1)))
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "jobs.cli", "run", config, "--run-dir", str(run_dir), "--set", "train.steps=100000"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    events = run_dir / "events.jsonl"
    deadline = time.monotonic() + 200  # an embedded Ray under load
    while not (events.exists() and events.read_text().count('"kind": "step"') >= 2):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate(timeout=60)
        time.sleep(0.05)
    (gcs,) = [p for p in psutil.Process(proc.pid).children(recursive=True) if p.name() == "gcs_server"]
    killed_at = time.time()
    gcs.kill()
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, err[-2000:]
    assert "Traceback" not in err and "Failed to connect to GCS" not in err, err[-3000:]  # not Ray's own end
    failed = [line for line in err.splitlines() if line.startswith("job failed: ")]
    assert len(failed) == 1 and "the Ray GCS at " in failed[0] and "is gone" in failed[0], err[-2000:]
    (end,) = [e for e in read_events(str(run_dir)) if e["kind"] == "job_end"]
    assert end["status"] == "failed" and failed[0] == f"job failed: {end['reason']}"
    assert end["ts"] - killed_at < 10, end["ts"] - killed_at  # within a poll, but for the load
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["steps"] == end["steps"] < 100000


@pytest.mark.parametrize("fault", ["file_size_limit", "run_dir_removed"])
def test_a_run_dir_that_can_no_longer_be_written_ends_the_job_failed_naming_why(
    ray_local, tiny_spec_dict, tmp_path, fault
):
    """The OS refusing the event log's writes mid-run (a file-size limit set on the running
    driver: the write fails as on a full disk, ``EFBIG`` for ``ENOSPC``), or the run directory
    removed under it: the job stops, exit 1, one line naming the cause, no traceback; a full
    disk keeps every whole line and a summary that could still be written."""
    config = _write_spec(tmp_path, tiny_spec_dict)
    run_dir = tmp_path / "run"
    proc = _run_until_steps(config, run_dir, ray_local.get_runtime_context().gcs_address, 3)
    if fault == "file_size_limit":
        size = (run_dir / "events.jsonl").stat().st_size
        resource.prlimit(proc.pid, resource.RLIMIT_FSIZE, (size + 600, resource.RLIM_INFINITY))
    else:
        shutil.rmtree(run_dir)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, err[-2000:]
    assert "Traceback" not in err, err[-3000:]
    failed = [line for line in err.splitlines() if line.startswith("job failed: ")]
    assert len(failed) == 1 and "the run directory can no longer be written" in failed[0], err[-2000:]
    if fault == "run_dir_removed":
        assert "events.jsonl was removed" in failed[0] and not run_dir.exists()
        return
    assert "File too large" in failed[0]
    assert (run_dir / "events.jsonl").read_text().endswith("\n")  # cut back to its last whole line
    events = read_events(str(run_dir))
    steps = [e["step"] for e in events if e["kind"] == "step"]
    assert len(steps) >= 3 and steps[-1] < 400
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["steps"] >= steps[-1]
