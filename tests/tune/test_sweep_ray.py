"""Sweeps on a real embedded Ray: trials are real elastic jobs in their Tune placement groups.

* the Python API on the shared local Ray (6 logical CPUs: 5 worker slots, so two 2-worker
  trials run at once): a trial made to fail by an injected worker fault is recorded as
  ``failed`` with its reason, the sweep goes on, trials overlap without oversubscribing, no
  actor or placement group of any trial is left afterwards, and ``Tuner.restore`` reads the
  experiment back;
* the CLI end to end (on the same Ray, by ``--address``): ``results.json`` with a status for every
  configuration, a ``best.yaml`` that ``elastic run`` runs, and a heatmap PNG.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import yaml

from elastic.faults import WorkerFaults, worker_fault
from elastic.tune.space import config_key
from jobs.spec import JobSpec

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(600)]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SPEC = {
    "name": "tiny",
    "model": {"n_layers": 2, "d_model": 32, "n_heads": 2, "vocab_size": 64, "seq_len": 16},
    "data": {"num_samples": 1000},
    "parallel": {"micro_batch": 2},
    "elastic": {"min_dp": 1, "max_dp": 2, "heartbeat_timeout_s": 30, "collective_timeout_s": 30},
    "train": {"global_batch": 8},
}
STATUSES = {"ok", "pruned_memory", "pruned_batch", "stopped_early", "oom", "failed"}


def _wait_until(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.2)


def test_failed_trial_is_a_result_trials_share_the_cluster_and_nothing_leaks(ray_local, tmp_path):
    from ray.util.placement_group import placement_group_table

    import elastic
    from elastic.tune.api import restore_trainable

    ray = ray_local
    before_pgs = set(placement_group_table())
    # The shared cluster may hold other tests' actors (Ray Data's detached system actors).
    before_actors = {a for a, v in ray._private.state.actors().items() if v["State"] != "DEAD"}
    spec = JobSpec.from_dict(SPEC)
    out = str(tmp_path / "sweep")
    grid = elastic.sweep(
        spec,
        space={"zero": [0, 3], "micro_batch": [2, 4]},
        trial_steps=4,
        exhaustive=True,
        out=out,
        faults=[({"zero": 3, "micro_batch": 4}, WorkerFaults([worker_fault("raise", step=3, rank=1)]))],
    )
    from ray.tune import ResultGrid

    assert isinstance(grid, ResultGrid) and len(grid) == 4
    entries = {config_key(e["config"]): e for e in json.load(open(os.path.join(out, "results.json")))}
    assert len(entries) == 4
    bad = entries["dp2-tp1-pp1-z3-mb4"]
    assert bad["status"] == "failed", bad
    assert "injected failure in step 3 on rank 1" in bad["reason"], bad["reason"]
    for key, e in entries.items():
        if key != "dp2-tp1-pp1-z3-mb4":
            assert e["status"] == "ok" and e["tokens_per_s"] > 0, e
            assert e["peak_mem_bytes"] and e["predicted_mem_bytes"], e
    assert os.path.exists(os.path.join(out, "best.yaml"))

    # Several trials ran at once (2 x 2 workers in 5 slots), never more than fit.
    spans = []
    for r in grid:
        df = r.metrics_dataframe
        t_end = float(df["timestamp"].max())
        spans.append((t_end - float(df["time_total_s"].max()), t_end))
    spans.sort()
    overlap = max(min(a[1], b[1]) - max(a[0], b[0]) for i, a in enumerate(spans) for b in spans[i + 1 :])
    assert overlap > 0, f"no two trials overlapped: {spans}"
    most = max(sum(1 for s in spans if s[0] <= t < s[1]) for t, _ in spans)
    assert most * (2 + 0.01) <= 6, f"{most} trials at once would oversubscribe 6 CPUs"

    # No actor or placement group of any trial is left.
    def leftovers():
        pgs = {k: v for k, v in placement_group_table().items() if k not in before_pgs and v["state"] != "REMOVED"}
        actors = [v for a, v in ray._private.state.actors().items() if v["State"] != "DEAD" and a not in before_actors]
        return pgs, actors

    _wait_until(lambda: leftovers() == ({}, []), 60, f"trial actors and placement groups to go: {leftovers()}")

    # The experiment restores with Tune's own tool.
    from ray import tune

    restored = tune.Tuner.restore(os.path.join(out, "tune"), trainable=restore_trainable(out, JobSpec)).get_results()
    assert sorted(config_key(r.config["cfg"]) for r in restored) == sorted(entries)


def test_cli_sweep_end_to_end_and_best_yaml_runs(ray_local, tmp_path):
    cfg = tmp_path / "job.yaml"
    cfg.write_text(yaml.safe_dump(SPEC))
    space = tmp_path / "space.yaml"
    # 4 configurations, 2 of them pruned before a trial (ZeRO at dp 1): the CLI's whole path at
    # the least trial time (the searchers are compared in tests/tune/ and benchmarks/sweep_vs_grid)
    space.write_text(yaml.safe_dump({"tp": [1, 2], "zero": [0, 1], "micro_batch": [8]}))
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    address = ["--address", ray_local.get_runtime_context().gcs_address]  # the shared local Ray
    out = tmp_path / "out"
    args = [sys.executable, "-m", "jobs.cli", "sweep", str(cfg), "--space", str(space), "--trial-steps", "4"]
    args += address
    p = subprocess.run(
        args + ["--out", str(out)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=500, check=False
    )
    assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-3000:])
    assert "memory model vs measured peak" in p.stdout and "trial" in p.stdout
    entries = json.load(open(out / "results.json"))
    assert len(entries) == 4 and {e["status"] for e in entries} <= STATUSES
    by = {config_key(e["config"]): e for e in entries}
    assert by["dp1-tp2-pp1-z1-mb8"]["status"] == "pruned_batch"  # dp 1: nothing to shard
    assert by["dp1-tp1-pp1-z0-mb8"]["config"]["grad_accum"] == 1  # 8 / 8: one micro-batch, dp 1
    ran = [e for e in entries if e["status"] in ("ok", "stopped_early") and e["trial_s"]]
    assert ran and all(abs(e["peak_mem_bytes"] / e["predicted_mem_bytes"] - 1) <= 0.15 for e in ran), ran
    png = (out / "heatmap.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000

    best = JobSpec.from_yaml(out / "best.yaml")
    top = max((e for e in entries if e["status"] == "ok"), key=lambda e: e["tokens_per_s"])
    assert (best.parallel.tp, best.parallel.zero, best.parallel.micro_batch) == tuple(
        top["config"][k] for k in ("tp", "zero", "micro_batch")
    )
    run = subprocess.run(
        [sys.executable, "-m", "jobs.cli", "run", str(out / "best.yaml"), "--set", "train.steps=2"]
        + ["--run-dir", str(tmp_path / "best-run")]
        + address,
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.load(open(tmp_path / "best-run" / "summary.json"))["status"] == "succeeded"
