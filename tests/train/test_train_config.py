"""elastic.train's configuration and Checkpoint: pure units, no Ray."""

from __future__ import annotations

import os

import pytest

from elastic.train import Checkpoint, CheckpointConfig, FailureConfig, RunConfig, ScalingConfig, get_context, report
from elastic.train.checkpoint import read_files, write_files
from elastic.train.config import check_writable

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"num_workers": (3, 2)}, "num_workers"),
        ({"num_workers": 0}, "num_workers"),
        ({"num_workers": "2"}, "num_workers"),
        ({"placement_strategy": "EVERYWHERE"}, "placement_strategy"),
        ({"resources_per_worker": {"CPU": -1}}, "resources_per_worker"),
    ],
)
def test_bad_scaling_config_names_its_field(kwargs, field):
    with pytest.raises(ValueError, match=f"ScalingConfig.{field}"):
        ScalingConfig(**kwargs)


def test_scaling_config_sizes_and_resources():
    sc = ScalingConfig(num_workers=(1, 4), use_gpu=True)
    assert (sc.min_workers, sc.max_workers, sc.elasticity_enabled) == (1, 4, True)
    assert sc.worker_resources() == {"CPU": 1.0, "GPU": 1.0}
    assert ScalingConfig(num_workers=2, resources_per_worker={"CPU": 2}).worker_resources() == {"CPU": 2.0}


def test_bad_run_configs_name_their_field(tmp_path):
    with pytest.raises(ValueError, match="FailureConfig.max_failures"):
        FailureConfig(max_failures=-2)
    with pytest.raises(ValueError, match="CheckpointConfig.num_to_keep"):
        CheckpointConfig(num_to_keep=0)
    with pytest.raises(ValueError, match="RunConfig.name"):
        RunConfig(name="a/b")
    blocked = tmp_path / "file"
    blocked.write_text("x")
    with pytest.raises(ValueError, match="RunConfig.storage_path"):
        check_writable(str(blocked / "below"))
    check_writable(str(tmp_path / "new"))
    assert RunConfig(storage_path="rel").resolved_storage_path() == os.path.abspath("rel")


def test_checkpoint_round_trip(tmp_path):
    src = tmp_path / "src"
    write_files({"model.pt": b"abc", "sub/opt.pt": b"de"}, str(src))
    ckpt = Checkpoint.from_directory(src)
    assert read_files(ckpt.to_directory(str(tmp_path / "copy"))) == {"model.pt": b"abc", "sub/opt.pt": b"de"}
    with ckpt.as_directory() as d:
        assert d == str(src)
    with pytest.raises(ValueError, match="from_directory"):
        Checkpoint.from_directory(tmp_path / "missing")


def test_session_functions_outside_a_loop_say_so():
    with pytest.raises(RuntimeError, match="outside a training loop"):
        get_context()
    with pytest.raises(ValueError, match="metrics must be a dict"):
        report([1])
