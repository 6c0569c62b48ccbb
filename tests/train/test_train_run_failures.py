"""A ``TorchTrainer`` run that cannot go on ends at once, failed, naming why: workers that
cannot load the loop (its module missing there, or raising at import) or a loop raising at
once, with the worker's own error; a run directory that can no longer be written, as
``elastic run``'s controller ends one (``EventLog.fault``)."""

from __future__ import annotations

import importlib
import json
import sys
import time

import pytest

import elastic.train as train
from elastic.events import read_events
from elastic.train.torch import TorchTrainer
from tests.train import loops

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]

PROMPT_S = 60.0  # a worker's start, under load: the driver waited 120 s before it answered


def _driver_only_loop(tmp_path, monkeypatch):
    """A loop from a module on the driver's path only (added after Ray started: the workers'
    path is the driver's at ``ray.init``), imported there as a script imports its own."""
    (tmp_path / "mods").mkdir()
    (tmp_path / "mods" / "driver_only_mod.py").write_text("def loop(config):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path / "mods"))
    module = importlib.import_module("driver_only_mod")
    monkeypatch.setitem(sys.modules, "driver_only_mod", module)  # gone again after the test
    return module.loop


@pytest.mark.parametrize(
    ("case", "error", "frame"),
    [
        ("driver_only", "ModuleNotFoundError: No module named 'driver_only_mod'", None),
        ("raises_at_import", "ImportError: libfoo.so.1: cannot open shared object file", "broken_on_workers.py"),
        ("raises_at_once", "ValueError: boom on rank", "in reporting_loop"),
    ],
)
def test_a_loop_the_workers_cannot_run_fails_at_once_with_their_error(
    ray_local, tmp_path, monkeypatch, case, error, frame
):
    if case == "driver_only":
        fn, config = _driver_only_loop(tmp_path, monkeypatch), None
    elif case == "raises_at_import":
        fn, config = importlib.import_module("tests.train.broken_on_workers").loop, None
    else:
        fn, config = loops.reporting_loop, {"fail": True}
    trainer = TorchTrainer(
        fn,
        train_loop_config=config,
        scaling_config=train.ScalingConfig(num_workers=2),
        run_config=train.RunConfig(name=case, storage_path=str(tmp_path / "runs")),
    )
    t0 = time.monotonic()
    with pytest.raises(train.TrainingFailedError) as info:
        trainer.fit()
    assert time.monotonic() - t0 < PROMPT_S
    message = str(info.value)
    assert error in message, message
    assert frame is None or frame in message, message  # the traceback's last frame: the worker's own
    assert error.split(":")[0] == type(info.value.__cause__).__name__
    run = tmp_path / "runs" / case
    failures = [e for e in read_events(str(run)) if e["kind"] == "failure"]
    assert len(failures) == 1 and failures[0]["cause"] == "worker_error" and error in failures[0]["detail"]
    end = read_events(str(run))[-1]
    assert end["kind"] == "job_end" and end["status"] == "failed" and error in end["reason"]
    assert json.loads((run / "summary.json").read_text())["status"] == "failed"


def test_a_run_dir_removed_mid_run_ends_it_failed_naming_why(ray_local, tmp_path, capfd):
    run = tmp_path / "runs" / "gone"
    trainer = TorchTrainer(
        loops.removing_loop,
        train_loop_config={"reports": 400, "remove_at": 3, "pace_s": 0.05, "run_dir": str(run)},
        scaling_config=train.ScalingConfig(num_workers=2),
        run_config=train.RunConfig(name="gone", storage_path=str(tmp_path / "runs")),
    )
    with pytest.raises(train.TrainingFailedError) as info:
        trainer.fit()
    message = str(info.value)
    assert message == f"the run directory can no longer be written: {run}/events.jsonl was removed while the job ran"
    assert info.value.__cause__ is None
    assert trainer.last_run["steps"] < 100  # stopped when it was found (at report 3), not at the loop's end
    assert not run.exists()  # nothing written there again
    assert "Traceback" not in capfd.readouterr().err
