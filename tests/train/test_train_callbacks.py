"""What hears a ``TorchTrainer`` run in the driver (``elastic/train/callbacks.py``): Ray
Train's ``UserCallback`` methods, the platform's ``Callback.after_event``, the progress
line and TensorBoard, each held against what the loop reported. Two workers on ``ray_local``."""

from __future__ import annotations

import os

import pytest

import elastic.train as train
from elastic.control.callbacks import Callback
from elastic.events import read_events
from elastic.train.torch import TorchTrainer
from tests.train import loops

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

REPORTS = loops.REPORTS


def expected(i):
    return [{"loss": 1.0 / i + r, "i": i, "rank": r} for r in range(2)]


class RayStyle:  # Ray Train V2's UserCallback interface, duck-typed as Ray's own is
    def __init__(self):
        self.reports, self.exceptions = [], []

    def after_report(self, run_context, metrics, checkpoint):
        files = None
        if checkpoint is not None:
            with checkpoint.as_directory() as d:
                files = sorted(os.listdir(d))
        self.reports.append((metrics, checkpoint and checkpoint.path, files, run_context.get_run_config().name))

    def after_exception(self, run_context, worker_exceptions):
        self.exceptions.append(worker_exceptions)


class Events(Callback):
    def __init__(self):
        self.events, self.closed = [], False

    def after_event(self, event):
        self.events.append(event)

    def close(self):
        self.closed = True


def _trainer(tmp_path, callbacks, **config):
    return TorchTrainer(
        loops.reporting_loop,  # the workers import it: a module of its own, as Ray needs
        train_loop_config=config,
        scaling_config=train.ScalingConfig(num_workers=2),
        run_config=train.RunConfig(name="cb", storage_path=str(tmp_path), callbacks=callbacks),
    )


def test_callbacks_progress_and_tensorboard_hear_every_report(ray_local, tmp_path, capsys):
    ray_style, events = RayStyle(), Events()
    result = _trainer(tmp_path, [ray_style, events]).fit()
    # after_report: once per step, in order, every rank's metrics; a checkpoint once committed
    assert [m for m, *_ in ray_style.reports] == [expected(i) for i in range(1, REPORTS + 1)]
    paths = [p for _, p, _, _ in ray_style.reports]
    assert paths == [None, None, f"{result.path}/checkpoint_000003", None, None, f"{result.path}/checkpoint_000006"]
    assert [f for _, _, f, _ in ray_style.reports if f] == [["part0.pt", "part1.pt"]] * 2
    assert {name for *_, name in ray_style.reports} == {"cb"} and ray_style.exceptions == []
    # after_event: every event of events.jsonl, in order; close at the end
    assert events.events == read_events(result.path) and events.closed
    # the progress line, as elastic run shows it
    out = capsys.readouterr().out
    assert "job started: dp=2 tp=1 pp=1 on 1 node(s)" in out and f"job succeeded after {REPORTS} steps" in out
    assert "step     1  loss 1.0000" in out
    # TensorBoard: rank 0's reported metrics and the step's loss, at each step
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(os.path.join(result.path, "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    for tag, want in (("report/loss", lambda i: 1.0 / i), ("train/loss", lambda i: 1.0 / i), ("report/i", float)):
        got = [(s.step, s.value) for s in acc.Scalars(tag)]
        assert got == [(i, pytest.approx(want(i), rel=1e-6)) for i in range(1, REPORTS + 1)], tag  # float32


def test_after_exception_hears_the_loops_error_from_every_rank(ray_local, tmp_path):
    ray_style = RayStyle()
    with pytest.raises(train.TrainingFailedError):
        _trainer(tmp_path, [ray_style], fail=True).fit()
    (seen,) = ray_style.exceptions
    assert sorted(seen) == [0, 1]
    assert all(isinstance(e, ValueError) and str(e) == f"boom on rank {r}" for r, e in seen.items())


def test_a_callback_without_a_hook_is_refused_before_anything_starts(no_ray, tmp_path):
    with pytest.raises(train.TrainConfigError, match=r"^RunConfig.callbacks\[1\]: object defines none of"):
        _trainer(tmp_path, [RayStyle(), object()]).fit()
