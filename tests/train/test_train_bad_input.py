"""Bad input to ``TorchTrainer``: one line naming the field (``TrainConfigError``) before
any actor starts, and a script that does not catch it exits 2 with that line on stderr.

What needs no cluster (the loop, ``num_workers``, ``datasets``, ``storage_path``) is
refused before Ray is even joined: those tests check that no Ray runtime was started. What
needs one (a resource no node has, ``use_gpu`` without a GPU) is refused after joining,
before the first actor: those count the cluster's actors (dead ones included) around it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import elastic.train as train
from elastic.train import RunConfig, ScalingConfig, TrainConfigError
from elastic.train.torch import TorchTrainer

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def loop(config):
    train.report({"loss": 1.0})


def _one_line(info: pytest.ExceptionInfo, field: str) -> str:
    message = str(info.value)
    assert "\n" not in message and field in message, message
    return message


def _actors() -> int:
    """Every actor the cluster has had (alive or dead). ``ray.util.state`` needs the
    dashboard, which the test clusters run without; the GCS table is read directly."""
    import ray._private.state

    return len(ray._private.state.actors())


@pytest.mark.parametrize(
    ("fn", "field"),
    [
        ("not a function", "train_loop_per_worker: a function, got str"),
        (lambda a, b: None, "train_loop_per_worker: takes no argument or one (the config), not (a, b)"),
        (lambda *, config: None, "train_loop_per_worker: takes no argument or one (the config), not (config)"),
    ],
)
def test_a_loop_that_is_not_callable_or_takes_the_wrong_arguments(no_ray, fn, field):
    with pytest.raises(TrainConfigError) as info:
        TorchTrainer(fn)
    _one_line(info, f"TorchTrainer.{field}")
    import ray

    assert not ray.is_initialized()


def test_loops_ray_train_accepts_are_accepted(no_ray):
    TorchTrainer(lambda: None)
    TorchTrainer(lambda config: None)
    TorchTrainer(lambda config, extra=1: None)
    TorchTrainer(train_loop_per_worker=loop, train_loop_config={"lr": 0.1})


def test_num_workers_min_above_max(no_ray):
    with pytest.raises(TrainConfigError) as info:
        TorchTrainer(loop, scaling_config=ScalingConfig(num_workers=(3, 2)))
    assert _one_line(info, "ScalingConfig.num_workers") == (
        "ScalingConfig.num_workers: need 1 <= min <= max, got (3, 2)"
    )


@pytest.mark.parametrize(
    ("datasets", "field"),
    [
        ({"train": torch.utils.data.TensorDataset(torch.zeros(4, 2))}, "TorchTrainer.datasets['train']"),
        ({"train": [1, 2, 3]}, "TorchTrainer.datasets['train']"),
        ([1, 2, 3], "TorchTrainer.datasets"),
    ],
)
def test_datasets_that_are_not_ray_datasets(no_ray, datasets, field):
    with pytest.raises(TrainConfigError) as info:
        TorchTrainer(loop, datasets=datasets)
    _one_line(info, field)
    import ray

    assert not ray.is_initialized()


def test_a_storage_path_that_cannot_be_written(no_ray, tmp_path):
    blocked = tmp_path / "a-file"
    blocked.write_text("x")
    trainer = TorchTrainer(loop, run_config=RunConfig(name="r", storage_path=str(blocked / "below")))
    with pytest.raises(TrainConfigError) as info:
        trainer.fit()
    _one_line(info, "RunConfig.storage_path")
    import ray

    assert not ray.is_initialized()  # refused before joining (or starting) a cluster


def test_an_unknown_resource_starts_no_actor(ray_local, tmp_path):
    before = _actors()
    trainer = TorchTrainer(
        loop,
        scaling_config=ScalingConfig(num_workers=1, resources_per_worker={"CPU": 1, "TPU-v9": 1}),
        run_config=RunConfig(name="r", storage_path=str(tmp_path)),
    )
    with pytest.raises(TrainConfigError) as info:
        trainer.fit()
    _one_line(info, "ScalingConfig.resources_per_worker['TPU-v9']: no node of the cluster has this resource")
    assert _actors() == before


def test_use_gpu_on_a_cluster_without_gpus_starts_no_actor(ray_local, tmp_path):
    if ray_local.cluster_resources().get("GPU", 0) >= 1:
        pytest.skip("this cluster has a GPU")
    before = _actors()
    trainer = TorchTrainer(
        loop,
        scaling_config=ScalingConfig(num_workers=1, use_gpu=True),
        run_config=RunConfig(name="r", storage_path=str(tmp_path)),
    )
    with pytest.raises(TrainConfigError) as info:
        trainer.fit()
    assert _one_line(info, "ScalingConfig.use_gpu") == "ScalingConfig.use_gpu: the Ray cluster has no GPU"
    assert _actors() == before


SCRIPT = """
import elastic.train as train
from elastic.train.torch import TorchTrainer


def loop(config):
    train.report({{"loss": 1.0}})


trainer = TorchTrainer(
    loop,
    scaling_config=train.ScalingConfig({scaling}),
    run_config=train.RunConfig(name="bad", storage_path={storage!r}),
)
trainer.fit()
print("not reached")
"""


def _script(tmp_path, scaling: str) -> subprocess.CompletedProcess:
    path = tmp_path / "script.py"
    path.write_text(textwrap.dedent(SCRIPT.format(scaling=scaling, storage=str(tmp_path / "runs"))))
    env = {**os.environ, "PYTHONPATH": ROOT}
    env.pop("RAY_ADDRESS", None)
    return subprocess.run(
        [sys.executable, str(path)], capture_output=True, text=True, timeout=150, env=env, cwd=str(tmp_path)
    )


def test_a_script_with_bad_input_exits_2_with_one_line(no_ray, tmp_path):
    proc = _script(tmp_path, "num_workers=(3, 2)")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.splitlines() == ["error: ScalingConfig.num_workers: need 1 <= min <= max, got (3, 2)"]
    assert proc.stdout == ""


def test_a_script_refused_after_joining_an_embedded_cluster_exits_2_with_one_line(no_ray, tmp_path):
    """The unknown resource is seen once the script has started its embedded Ray: the
    excepthook stops that Ray and still prints only the one line."""
    proc = _script(tmp_path, "num_workers=1, resources_per_worker={'CPU': 1, 'TPU-v9': 1}")
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "error: ScalingConfig.resources_per_worker['TPU-v9']: no node of the cluster has this resource"
    ), proc.stderr[-2000:]
    assert "not reached" not in proc.stdout
