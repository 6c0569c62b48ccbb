"""The storage tier in real runs: async vs sync blocking, S3 with no leaked secrets, an outage."""

from __future__ import annotations

import os

import pytest
from ckpt_testlib import ckpt_spec, events
from storage_testlib import FAKE_KEY, FAKE_SECRET

from elastic import ElasticTrainer
from elastic.checkpoint.storage_tier import open_store
from elastic.control.callbacks import Callback
from elastic.faults import WorkerFaults, worker_fault

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

# ~3.4M parameters (41 MB with the AdamW moments): the copy and the write take measurable time.
MEDIUM = {"n_layers": 4, "d_model": 256, "n_heads": 4, "vocab_size": 512, "seq_len": 16}


def _blocking_run(tiny, tmp_path, name: str, async_: bool):
    spec = ckpt_spec(
        tiny,
        str(tmp_path / name / "ckpt"),
        model=MEDIUM,
        train={"steps": 6},
        elastic={"max_dp": 1},
        checkpoint={"every_steps": 2, "async": async_},
    )
    run_dir = str(tmp_path / name)
    assert ElasticTrainer(spec, run_dir=run_dir).fit().status == "succeeded"
    stored = events(run_dir, "checkpoint", tier="storage")
    assert [(e["step"], e["committed"]) for e in stored] == [(2, True), (4, True), (6, True)]
    memory = {e["step"]: e for e in events(run_dir, "checkpoint", tier="memory")}
    return stored, memory


def test_async_save_blocks_no_longer_than_the_cpu_snapshot(ray_local, tiny_spec_dict, tmp_path):
    """Async: the loop is held for starting the memory snapshot and queueing the upload, never
    for the write. Compared with what the same run measured (the write's own duration) and
    with a sync run of the same steps, not with a fixed slack: the bounds hold on a loaded
    machine, where every duration stretches alike."""
    stored, _ = _blocking_run(tiny_spec_dict, tmp_path, "async", True)
    sync_stored, sync_memory = _blocking_run(tiny_spec_dict, tmp_path, "sync", False)
    for e in sync_stored:  # sync: the copy and the whole write hold the loop
        if e["step"] in sync_memory:
            assert e["blocking_s"] > sync_memory[e["step"]]["duration_s"], e
    sync_by_step = {e["step"]: e for e in sync_stored}
    for e in stored:
        assert e["blocking_s"] < e["duration_s"], e  # the write ran off the training thread
        assert e["blocking_s"] < sync_by_step[e["step"]]["blocking_s"], (e, sync_by_step[e["step"]])
    mean = lambda evs: sum(e["blocking_s"] for e in evs) / len(evs)  # noqa: E731
    assert mean(stored) * 3 < mean(sync_stored), (mean(stored), mean(sync_stored))


def test_s3_run_commits_and_leaks_no_secret(ray_local, tiny_spec_dict, tmp_path, moto_s3, s3_bucket):
    uri = f"s3://{s3_bucket}/runs/ckpt"
    spec = ckpt_spec(
        tiny_spec_dict, uri, train={"steps": 4}, checkpoint={"every_steps": 2, "storage_options": moto_s3.options()}
    )
    run_dir = tmp_path / "run"
    result = ElasticTrainer(spec, run_dir=str(run_dir)).fit()
    assert result.status == "succeeded" and result.dp_history == [[0, 2]]
    stored = events(str(run_dir), "checkpoint", tier="storage")
    assert [(e["step"], e["committed"]) for e in stored] == [(2, True), (4, True)]
    store = open_store(uri, moto_s3.options())
    assert [i.step for i in store.list_committed()] == [2, 4] and store.verify(4) == []
    # DDP at dp 2: replicated state is written once, by DP rank 0 (rank 1 writes no data file)
    assert not any(f.startswith("__1_") for f in store.read_manifest(4).files)
    texts = [p.read_bytes() for p in run_dir.rglob("*") if p.is_file()]
    texts += list(moto_s3.all_objects(s3_bucket).values())
    for secret in (FAKE_SECRET, FAKE_KEY):
        assert not any(secret.encode() in t for t in texts), secret


def test_s3_outage_mid_run_fails_only_those_checkpoints(ray_local, tiny_spec_dict, tmp_path, moto_s3, s3_bucket):
    """The server goes down after step 5 and comes back after step 16; the run goes on."""
    uri = f"s3://{s3_bucket}/outage"
    options = dict(moto_s3.options(), retry={"initial_s": 0.05, "max_s": 0.2, "deadline_s": 1.0})
    steps = 24
    spec = ckpt_spec(
        tiny_spec_dict,
        uri,
        train={"steps": steps},
        elastic={"max_dp": 1},
        checkpoint={"every_steps": 2, "keep": 100, "storage_options": options},
    )
    slow = [worker_fault("hang", s, rank=0, seconds=0.3) for s in range(1, steps + 1)]

    class Outage(Callback):
        def after_step(self, step, group):
            if step == 5:
                moto_s3.stop()
            elif step == 16:
                moto_s3.start()

    run_dir = str(tmp_path / "run")
    result = ElasticTrainer(spec, run_dir=run_dir, callbacks=[Outage()], step_hook=WorkerFaults(slow)).fit()
    assert result.status == "succeeded" and result.steps == steps and result.failures == 0
    stored = events(run_dir, "checkpoint", tier="storage")
    failed = [e for e in stored if not e["committed"]]
    committed = sorted(e["step"] for e in stored if e["committed"])
    assert failed and all(e["error"] for e in failed), stored
    assert [(f["step"], f["cause"]) for f in result.checkpoint_failures] == [(e["step"], e["error"]) for e in failed]
    assert steps in committed and max(e["step"] for e in failed) < steps
    assert any(s > max(e["step"] for e in failed) for s in committed)  # uploads recovered
    store = open_store(uri, options)
    assert [i.step for i in store.list_committed()] == committed  # none lost, no failed one committed
    assert all(store.verify(s) == [] for s in committed)
    assert not any(FAKE_SECRET in str(e) for e in stored)
    assert os.path.exists(os.path.join(run_dir, "summary.json"))
