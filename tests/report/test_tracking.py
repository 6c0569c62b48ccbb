"""Experiment tracking without Ray, on a scripted event stream: the scalars each event
becomes, the TensorBoard files read back by the real ``tensorboard`` package, MLflow's real
local file store, and W&B through a stand-in for the ``wandb`` module (its real client
needs a network or a login)."""

from __future__ import annotations

import sys

import pytest
from tracking_fakes import FakeWandb

from elastic.report.tracking import EventScalars, TensorBoardWriter, tensorboard_dir

pytestmark = pytest.mark.timeout(60)

T0 = 1_700_000_000.0


def stream() -> list[dict]:
    """A run of 3 steps at dp 4, a node lost after step 2, step 2 redone at dp 3, an eval after step 3."""

    def step(n, ts, loss, dp, **extra):
        fields = dict(loss=loss, dp=dp, grad_accum=12 // dp, step_time_s=0.5, tokens_per_s=384.0 / 0.5)
        fields |= dict(grad_norm=1.0 / n, data_wait_s=0.01 * n, compute_s=0.4, peak_mem_bytes=1000 * n)
        return {"ts": ts, "kind": "step", "step": n, **fields, **extra}

    return [
        {"ts": T0, "kind": "job_start", "dp": 4, "tp": 1, "pp": 1, "nodes": 4},
        step(1, T0 + 1, 4.0, 4),
        {"ts": T0 + 1.1, "kind": "checkpoint", "step": 1, "tier": "memory", "blocking_s": 0.002, "duration_s": 0.01},
        step(2, T0 + 2, 3.5, 4, mfu=0.25),
        {"ts": T0 + 2.5, "kind": "failure", "cause": "node_lost", "ranks": [3], "nodes": ["n3"], "detail": ""},
        {"ts": T0 + 3, "kind": "resize", "old_dp": 4, "new_dp": 3, "grad_accum": 4, "reason": "node_lost"},
        {"ts": T0 + 3.2, "kind": "restore", "step": 1, "source": "memory", "duration_s": 0.3},
        step(2, T0 + 4.5, 3.4, 3),
        step(3, T0 + 5, 3.0, 3),
        {"ts": T0 + 5.05, "kind": "eval", "step": 3, "eval_loss": 3.2, "duration_s": 0.04, "rows": 11},
        {"ts": T0 + 5.1, "kind": "job_end", "status": "succeeded", "steps": 3},
    ]


EXPECTED = [  # (step, scalars) per event of ``stream``, None where nothing is logged
    (0, {"elastic/dp": 4.0}),
    (1, {"train/loss": 4.0, "train/grad_norm": 1.0, "perf/tokens_per_s": 768.0, "perf/step_time_s": 0.5,
         "perf/data_wait_s": 0.01, "perf/compute_s": 0.4, "perf/peak_mem_bytes": 1000.0, "elastic/dp": 4.0,
         "elastic/grad_accum": 3.0}),
    (1, {"checkpoint/memory_blocking_s": 0.002}),
    (2, {"train/loss": 3.5, "train/grad_norm": 0.5, "perf/tokens_per_s": 768.0, "perf/step_time_s": 0.5,
         "perf/mfu": 0.25, "perf/data_wait_s": 0.02, "perf/compute_s": 0.4, "perf/peak_mem_bytes": 2000.0,
         "elastic/dp": 4.0, "elastic/grad_accum": 3.0}),
    (2, {"elastic/failures": 1.0}),
    (2, {"elastic/dp": 3.0}),
    (1, {"elastic/restore_s": 0.3}),
    (2, {"train/loss": 3.4, "train/grad_norm": 0.5, "perf/tokens_per_s": 768.0, "perf/step_time_s": 0.5,
         "perf/data_wait_s": 0.02, "perf/compute_s": 0.4, "perf/peak_mem_bytes": 2000.0, "elastic/dp": 3.0,
         "elastic/grad_accum": 4.0, "elastic/recoveries": 1.0, "elastic/step_gap_s": 2.5}),
    (3, {"train/loss": 3.0, "train/grad_norm": 1 / 3, "perf/tokens_per_s": 768.0, "perf/step_time_s": 0.5,
         "perf/data_wait_s": 0.03, "perf/compute_s": 0.4, "perf/peak_mem_bytes": 3000.0, "elastic/dp": 3.0,
         "elastic/grad_accum": 4.0}),
    (3, {"eval/loss": 3.2}),
    None,
]  # fmt: skip


def test_event_scalars():
    scalars = EventScalars()
    got = [scalars(e) for e in stream()]
    assert got == EXPECTED
    assert (scalars.failures, scalars.recoveries, scalars.step) == (1, 1, 3)


def test_tensorboard_files_read_back_by_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    writer = TensorBoardWriter(str(tmp_path / "tb"))
    for e in stream():
        writer(e)
    writer.close()
    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    logged = {}
    for i, record in enumerate(EXPECTED):
        if record is not None:
            for name, value in record[1].items():
                logged.setdefault(name, []).append((record[0], value, stream()[i]["ts"]))
    assert set(acc.Tags()["scalars"]) == set(logged)
    for name, points in logged.items():
        read = [(s.step, s.value, s.wall_time) for s in acc.Scalars(name)]
        assert [r[0] for r in read] == [p[0] for p in points], name  # a redone step appears twice
        assert [r[1] for r in read] == pytest.approx([p[1] for p in points], rel=1e-6), name  # float32
        assert [r[2] for r in read] == pytest.approx([p[2] for p in points], abs=1e-3), name


def test_tensorboard_setting():
    assert tensorboard_dir(False, "/runs/a") is None
    assert tensorboard_dir(True, "/runs/a") == "/runs/a/tensorboard"
    assert tensorboard_dir("/tb/mine", "/runs/a") == "/tb/mine"
    from elastic.errors import SpecError
    from jobs import JobSpec

    assert JobSpec.from_dict({"train": {"tensorboard": True}}).train.tensorboard is True
    with pytest.raises(SpecError) as info:
        JobSpec.from_dict({"train": {"tensorboard": " "}})
    assert info.value.field == "train.tensorboard"


def test_mlflow_local_file_store(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    from elastic.report.trackers import MlflowCallback

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps the file store behind this switch
    uri = (tmp_path / "mlruns").as_uri()
    cb = MlflowCallback(tracking_uri=uri, experiment="tests", run_name="scripted", params={"model": "gpt"})
    for e in stream():
        cb.after_event(e)
    run_id = cb.run_id
    cb.close()
    client = MlflowClient(uri)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "scripted"
    assert run.data.params == {"dp": "4", "tp": "1", "pp": "1", "nodes": "4", "model": "gpt"}
    losses = [(m.step, m.value, m.timestamp) for m in client.get_metric_history(run_id, "train/loss")]
    assert losses == [(1, 4.0, int((T0 + 1) * 1000)), (2, 3.5, int((T0 + 2) * 1000)),
                      (2, 3.4, int((T0 + 4.5) * 1000)), (3, 3.0, int((T0 + 5) * 1000))]  # fmt: skip
    assert [m.value for m in client.get_metric_history(run_id, "elastic/dp")] == [4.0, 4.0, 4.0, 3.0, 3.0, 3.0]
    assert client.get_metric_history(run_id, "elastic/step_gap_s")[0].value == 2.5
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "eval/loss")] == [(3, 3.2)]
    # A failed job ends its run FAILED.
    failed = MlflowCallback(tracking_uri=uri, experiment="tests")
    for e in [*stream()[:-1], {"ts": T0 + 6, "kind": "job_end", "status": "failed", "steps": 3}]:
        failed.after_event(e)
    failed_id = failed.run_id
    failed.close()
    assert client.get_run(failed_id).info.status == "FAILED"


def test_wandb_callback_against_the_wandb_api(monkeypatch):
    from elastic.report.trackers import WandbCallback

    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    cb = WandbCallback(config={"model": "gpt"}, project="elastic", mode="offline")
    for e in stream():
        cb.after_event(e)
    cb.close()
    init, define, *logs, finish = fake.calls
    assert init == ("init", {"config": {"model": "gpt", "layout": {"dp": 4, "tp": 1, "pp": 1, "nodes": 4}},
                             "project": "elastic", "mode": "offline"})  # fmt: skip
    assert define == ("define_metric", "*", "step") and finish == ("finish",)
    assert [c[1] for c in logs] == [{"step": r[0], **r[1]} for r in EXPECTED if r is not None]


def test_missing_package_and_failing_tracker(monkeypatch, caplog):
    from elastic.report.trackers import MlflowCallback, WandbCallback

    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    with pytest.raises(ImportError, match="pip install wandb"):
        WandbCallback()
    monkeypatch.setitem(sys.modules, "mlflow", None)
    with pytest.raises(ImportError, match="pip install mlflow"):
        MlflowCallback()
    # A tracker that raises is disabled after logging once; the run never sees the error.
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    cb = WandbCallback()
    for e in stream()[:2]:
        cb.after_event(e)

    def broken(*args, **kwargs):
        raise RuntimeError("network down")

    cb.run.log = broken
    for e in stream()[2:]:
        cb.after_event(e)
    assert cb.sink.failed and caplog.text.count("wandb disabled after an error") == 1
