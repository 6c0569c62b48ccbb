"""The benchmarks run in the suite, at their smallest settings (``Benchmark.smoke`` in
``benchmarks/catalog.py``), so that a change that breaks one fails here and not at its next
published run. Each runs as ``python -m benchmarks.X`` in its own process; a benchmark whose
``needs`` this machine lacks (a GPU, torchtitan) is skipped, saying which.

``test_every_benchmark_is_covered`` keeps a new benchmark from escaping: it must carry smoke
settings, or needs a machine may lack (a GPU, torchtitan). Each smoke run has its own time
limit (``Benchmark.smoke_timeout_s``); the multi-node ones take minutes, and ``make test``
runs them beside the 4-node cluster tests (two xdist workers, tests/conftest.py).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from benchmarks import catalog

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Run once each, by a test that checks more than the generic smoke test below does.
CHECKED_ELSEWHERE = {
    "control_plane": "tests/test_benchmarks_run.py",
    "train_api_recovery": "tests/test_benchmarks_run.py",
    "gpu_check": "tests/gpu/test_gpu_check.py",  # its --dry-run, with a hung part injected
}


def test_every_benchmark_is_covered():
    """Every catalog entry runs in the suite at its smoke settings, or needs what a machine may
    lack; one checked elsewhere is run there (its test names the module)."""
    for b in catalog.BENCHMARKS:
        assert b.smoke is not None or b.needs, f"{b.name}: give it smoke settings (its smallest run)"
        assert b.smoke_timeout_s > 0, b.name
    for name, where in CHECKED_ELSEWHERE.items():
        with open(os.path.join(ROOT, where)) as f:
            text = f.read()
        assert catalog.by_name([name])[0].module in text or f'"{name}"' in text, (name, where)


@pytest.mark.parametrize("bench", [b for b in catalog.BENCHMARKS if b.needs], ids=lambda b: b.name)
def test_a_benchmark_that_needs_what_is_missing_says_why(bench):
    """A benchmark with ``needs`` runs where they are met; here it is skipped, naming them."""
    missing = bench.missing()
    if missing:
        pytest.skip("; ".join(f"no {n.what}: {n.how}" for n in missing))
    assert bench.smoke is not None, f"{bench.name}: its needs are met here, but it has no smoke settings"


def _last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


SMOKE = [
    pytest.param(b, marks=pytest.mark.timeout(b.smoke_timeout_s + 30), id=b.name)
    for b in catalog.BENCHMARKS
    if b.smoke is not None and not b.needs and b.name not in CHECKED_ELSEWHERE
]


@pytest.mark.cluster
@pytest.mark.parametrize("bench", SMOKE)
def test_a_benchmark_runs_at_its_smoke_settings(bench, tmp_path):
    """Each benchmark with smoke settings (but ``CHECKED_ELSEWHERE``) runs to the end at them,
    in its own process, and writes its results where it is told (``{out}`` in its settings: a
    file under ``tmp_path``, never ``benchmarks/results/``)."""
    out = tmp_path / "out.json"
    args = [a.replace("{out}", str(out)).replace("{out_dir}", str(tmp_path)) for a in bench.smoke or ()]
    done = subprocess.run(
        [sys.executable, "-m", bench.module, *args], capture_output=True, text=True, timeout=bench.smoke_timeout_s
    )
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-3000:])
    if any("{out}" in a for a in bench.smoke or ()):
        doc = json.loads(out.read_text())
        assert doc, out
        for check in RESULT_CHECKS.get(bench.name, ()):
            check(doc)


def _finite_positive(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def _sdc_ratio(doc: dict) -> None:
    assert {"step_s_off", "step_s_on", "ratio_on_off", "ratio_median"} <= set(doc), sorted(doc)
    assert all(map(_finite_positive, doc["step_s_off"] + doc["step_s_on"] + doc["ratio_on_off"])), doc
    assert _finite_positive(doc["ratio_median"]), doc


def _peer_fetch_ratio(doc: dict) -> None:
    for size in doc["sizes_mb"]:
        row = doc["summary"][str(size)]
        assert _finite_positive(row["object_store_over_stream"]), row
        assert all(_finite_positive(row["fetch_s"][way]["median"]) for way in ("stream", "object_store")), row


def _survivor_first_step_ratio(doc: dict) -> None:
    assert set(doc["results"]) == {"ddp_50mb", "hsdp_50mb"}, sorted(doc["results"])
    for row in doc["results"].values():
        assert _finite_positive(row["first_over_after"]["median"]) and _finite_positive(row["cold_first_s"]), row


def _prepare_ratio(doc: dict) -> None:
    (row,) = doc["sizes"].values()
    assert row["tokens"] > 0 and _finite_positive(row["ratio_median"]), row


def _rank_start_ratio(doc: dict) -> None:
    assert all(_finite_positive(doc["summary"][side]["start_s"]["median"]) for side in ("product", "baseline")), doc
    assert _finite_positive(doc["ratio_baseline_over_product"]["start_s"]), doc


def _layouts_measured(doc: dict) -> None:
    assert len(doc["layouts"]) >= 4, doc["layouts"]
    for row in doc["layouts"]:
        assert _finite_positive(row["tokens_per_s"]) and _finite_positive(row["measured"]["peak_bytes_max_rank"]), row


def _restore_waves_bounded(doc: dict) -> None:
    for name, row in doc["configs"].items():
        assert row["gets"]["median"] > 0 and _finite_positive(row["restore_s"]["median"]), (name, row)
        if row["bound"] is not None:  # the staggered restores keep their bound at the server
            assert row["peak_gets_in_flight"]["max"] <= row["bound"], (name, row)


def _job_start_ratio(doc: dict) -> None:
    for part in ("handle", "fit"):
        assert all(map(_finite_positive, doc[part]["ratio_baseline_over_product"].values())), doc[part]


def _drain_and_kill_both_recover(doc: dict) -> None:
    modes = {r["mode"]: r for r in doc["runs"]}
    assert set(modes) == {"drain", "kill"} and all(r["status"] == "succeeded" for r in modes.values()), modes
    assert modes["drain"]["failures"] == 0 and modes["kill"]["failures"] == 1, modes  # a drain is no failure
    assert all(_finite_positive(r["gap_s"]) for r in modes.values()), modes


def _recovery_costed(doc: dict) -> None:
    for name, row in doc["scenarios"].items():
        assert row["succeeded"] == row["runs"] >= 1 and row["lost_steps"] == [0] * row["runs"], (name, row)
        assert _finite_positive(row["cost_s"]["median"]) and row["store_ops_per_rank"]["median"] > 0, (name, row)


def _recovery_side_by_side(doc: dict) -> None:
    summary = doc["summary"]
    assert {"ours", "raytrain_tuned"} <= set(summary), sorted(summary)
    for side in ("ours", "raytrain_tuned"):
        assert summary[side]["statuses"] == ["succeeded"] and _finite_positive(summary[side]["recovery_s"]["median"])
    assert summary["ours"]["lost_steps"]["max"] == 0, summary["ours"]
    assert _finite_positive(doc["ratios"]["ours/raytrain_tuned"]), doc["ratios"]


def _overhead_same_losses(doc: dict) -> None:
    assert _finite_positive(doc["ratio"]) and all(map(_finite_positive, doc["mean_tokens_per_s"].values())), doc
    assert doc["max_loss_rel_diff"] < 1e-5, doc["max_loss_rel_diff"]  # both sides train the same model


def _bytes_accounted(doc: dict) -> None:
    for run in doc["runs"]:
        for version in ("v1", "v2", "v3"):
            row = run[version]
            assert row["bytes_read_total"] > 0 and row["unattributed_bytes"] == 0, (run["hosts"], version, row)


def _sweep_and_grid_ran(doc: dict) -> None:
    assert doc["grid"]["trials"] >= 1 and all(s["trials"] >= 1 for s in doc["sweeps"]), doc["grid"]
    assert all(_finite_positive(r["best_ratio"]) for r in doc["ratios"]), doc["ratios"]
    assert doc["memory_errors"] and all(math.isfinite(x) for x in doc["memory_errors"]), doc["memory_errors"]


def _ingest_parts(doc: dict) -> None:
    assert {"storage_burst", "data_wait", "prepare_throughput", "duplicate_reads"} <= set(doc), sorted(doc)
    for name, row in doc["storage_burst"].items():  # the staggered reads' bound (docs/data.md)
        assert 1 <= row["startup_peak_gets"] <= row["bound_startup"] and row["gets"] > 0, (name, row)
        assert row["after_node_loss_peak_gets"] <= row["bound_after_loss"], (name, row)
    assert all("failed" not in row for row in doc["data_wait"].values()), doc["data_wait"]
    assert _finite_positive(doc["duplicate_reads"]["ratio_tp2_over_tp1"]), doc["duplicate_reads"]


# What a smoke run's results must hold, beyond being JSON (a benchmark that ran but measured
# nothing fails here).
RESULT_CHECKS = {
    "sdc_overhead": (_sdc_ratio,),
    "peer_fetch": (_peer_fetch_ratio,),
    "survivor_first_step": (_survivor_first_step_ratio,),
    "prepare_throughput": (_prepare_ratio,),
    "rank_start": (_rank_start_ratio,),
    "parallel_layouts": (_layouts_measured,),
    "restore_waves": (_restore_waves_bounded,),
    "job_start": (_job_start_ratio,),
    "drain_vs_kill": (_drain_and_kill_both_recover,),
    "recovery_scaling": (_recovery_costed,),
    "recovery_vs_raytrain": (_recovery_side_by_side,),
    "overhead": (_overhead_same_losses,),
    "data_bytes_per_host": (_bytes_accounted,),
    "sweep_vs_grid": (_sweep_and_grid_ran,),
    "data_ingest": (_ingest_parts,),
}


def test_parallel_layouts_refuses_a_model_its_layouts_cannot_take():
    """At one layer (PP 2 needs two) each rank raised and the benchmark exited 1 with a
    traceback per rank; now one line and exit 2, before any rank starts."""
    args = ["--layers", "1", "--d-model", "32", "--heads", "4", "--vocab", "64", "--seq", "16"]
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.parallel_layouts", *args], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "layout DP2xPP2 does not fit the model" in done.stderr.strip().splitlines()[-1], done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.cluster
@pytest.mark.timeout(240)
def test_control_plane_runs_through_its_stall_node_loss_and_grow_back():
    """32 virtual ranks on 4 nodes (2 aggregators, 2 agent actors): the driver stall gives no
    false failure, the lost node's replica is dropped, and the returning node is grown into
    through the non-blocking start (``spawn_begin``/``spawn_end``)."""
    b = catalog.by_name(["control_plane"])[0]
    assert b.smoke is not None
    done = subprocess.run([sys.executable, "-m", b.module, *b.smoke], capture_output=True, text=True, timeout=200)
    assert done.returncode == 0, done.stderr[-3000:]
    out = _last_json(done.stdout)
    nodes = out["nodes"]
    assert out["ranks"] == 32 and nodes == 4 and out["aggregator_actors"] >= 2
    assert out["false_failures"] == 0
    assert out["dp_after_loss"] == nodes - 1
    assert out["dp_after_grow"] == nodes
    assert out["recovery_decision_s"] is not None and out["recovery_decision_s"] < 5.0


def _importable(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


@pytest.mark.cluster
@pytest.mark.slow
@pytest.mark.timeout(420)
def test_train_api_recovery_takes_ray_train_through_a_node_loss_and_ours_or_says_why():
    """The same user script on Ray Train V2 and on ``elastic.train``, a node killed at step 7
    (a checkpoint every 5 steps, 20 steps of 48 rows): Ray Train restarts its workers at 3
    from the checkpoint and its loader begins the epoch again, so the rows of the steps before
    it are trained twice and as many never (``DistributedSampler`` shuffles by the same seed
    at every size); ours trains each row once, or is skipped saying why when
    ``elastic.train.torch`` does not import."""
    b = catalog.by_name(["train_api_recovery"])[0]
    assert b.smoke is not None
    done = subprocess.run([sys.executable, "-m", b.module, *b.smoke], capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    out = _last_json(done.stdout)
    ray = out["runs"]["raytrain"][0]
    assert ray["status"] == "succeeded", ray
    assert (ray["old_size"], ray["new_size"]) == (4, 3), ray
    # From the checkpoint of step 5 (the killed rank holds after step 7, so the kill lands
    # there on both sides); the loader's new epoch at 3 ranks trains again the rows of the
    # steps before it, and as many rows at the end of the epoch are never reached.
    resume = ray["resume_step"]
    assert resume == 5 and ray["last_step_at_old_size"] == 7 and ray["steps_trained_again"] == 2, ray
    twice = resume * 48
    assert (ray["rows_twice"], ray["rows_never"], ray["rows_once"], ray["rows_more"]) == (
        twice,
        twice,
        960 - 2 * twice,
        0,
    )
    assert ray["recovery_s"] > 0 and ray["epoch_steps_done"] == 20 and ray["survivor_processes_kept"] == 0
    ours = out["runs"]["ours"][0]
    if not _importable("elastic.train.torch"):
        assert ours["status"] == "skipped" and "elastic.train.torch" in ours["error"], ours
        return
    assert ours["status"] == "succeeded", ours
    assert (ours["old_size"], ours["new_size"]) == (4, 3), ours
    assert (ours["rows_once"], ours["rows_twice"], ours["rows_never"]) == (960, 0, 0), ours
    assert ours["last_step_at_old_size"] == 7 and ours["steps_trained_again"] <= ray["steps_trained_again"], ours
    assert ours["survivor_processes_kept"] == 3  # a node loss never restarts a survivor's process
