"""Ray Train's own example scripts, as they ship in the ``ray`` wheel
(``ray/train/examples/pytorch/``), run on ``elastic.train``: each file's text with every
``ray.train`` replaced by ``elastic.train``, executed as a module, its own functions called.

Nothing in their training loops is changed. Two scripts read data this machine cannot
reach, and only that source is swapped: ``torch_quick_start.py``'s ``get_dataset``
(torchvision's FashionMNIST, a download) for a local synthetic set of the same shape
(28x28 one-channel images, 10 classes), and ``torch_regression_example.py``'s S3 CSV for a
local CSV of the same columns (``x000``..``x099``, ``y``), read by the same
``ray.data.read_csv``. ``torch_quick_start.py`` reports nothing (it prints each epoch's
last loss): its ``print`` is observed, not replaced in the loop.

The modules are executed without being registered in ``sys.modules``, so that Ray's
pickler sends their functions and classes to the workers by value, as it does a script's
``__main__``.
"""

from __future__ import annotations

import json
import os
import types

import numpy as np
import pytest
import ray

from elastic.events import read_events

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(400)]

EXAMPLES = os.path.join(os.path.dirname(ray.__file__), "train", "examples", "pytorch")


def _example(name: str, swaps: dict[str, str] | None = None, preamble: str = "", main: bool = False):
    """The example ``name`` with ``ray.train`` -> ``elastic.train`` (and each of ``swaps``,
    each of which must occur exactly once), executed as a fresh module."""
    path = os.path.join(EXAMPLES, name)
    with open(path) as f:
        text = f.read()
    assert "ray.train" in text
    text = text.replace("ray.train", "elastic.train")
    for old, new in (swaps or {}).items():
        assert text.count(old) == 1, f"{name}: the text to swap is not there once: {old[:60]!r}"
        text = text.replace(old, new)
    assert "ray.train" not in text
    module = types.ModuleType("__main__" if main else name.removesuffix(".py"))
    module.__file__ = path
    exec(compile(preamble, f"<{name} test preamble>", "exec"), module.__dict__)
    exec(compile(text, path, "exec"), module.__dict__)
    return module


def _run_dir(storage: str) -> str:
    runs = [d for d in os.listdir(storage) if d.startswith("TorchTrainer_")]
    assert len(runs) == 1, runs
    return os.path.join(storage, runs[0])


def _committed(run_dir: str) -> list[str]:
    records = sorted(os.listdir(os.path.join(run_dir, ".elastic")))
    kept = sorted(d for d in os.listdir(run_dir) if d.startswith("checkpoint_"))
    assert [r.removesuffix(".json") for r in records] == kept
    return kept


def _summary(run_dir: str) -> dict:
    with open(os.path.join(run_dir, "summary.json")) as f:
        return json.load(f)


def test_torch_linear_example(ray_local, tmp_path):
    """``train_linear(num_workers=2, storage_path=...)``: 3 epochs, a report with a
    checkpoint each (the validation loss), the loss going down."""
    example = _example("torch_linear_example.py")
    metrics = example.train_linear(num_workers=2, storage_path=str(tmp_path))
    assert set(metrics) == {"loss"} and np.isfinite(metrics["loss"])
    run_dir = _run_dir(str(tmp_path))
    summary = _summary(run_dir)
    assert summary["status"] == "succeeded" and summary["steps"] == 3 and summary["failures"] == 0
    losses = [e["loss"] for e in read_events(run_dir) if e["kind"] == "step"]
    assert len(losses) == 3 and losses[-1] < losses[0] and losses[-1] == pytest.approx(metrics["loss"])
    assert _committed(run_dir) == ["checkpoint_000001", "checkpoint_000002", "checkpoint_000003"]
    assert os.path.getsize(os.path.join(run_dir, "checkpoint_000003", "model.pt")) > 0


# The quick start's data function, swapped for a local set of FashionMNIST's shape: 10 fixed
# random patterns, each image one of them plus noise (learnable, so its loss must go down).
SYNTHETIC_FASHION = """
import torch as _torch


class _SyntheticFashion(_torch.utils.data.Dataset):
    def __init__(self, n=2048, seed=0):
        g = _torch.Generator().manual_seed(seed)
        patterns = (_torch.rand(10, 1, 28, 28, generator=g) > 0.5).float()
        self.labels = _torch.randint(0, 10, (n,), generator=g)
        noise = 0.3 * _torch.rand(n, 1, 28, 28, generator=g)
        self.images = (0.7 * patterns[self.labels] + noise).clamp(0, 1)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return self.images[i], int(self.labels[i])


def get_dataset():
    return _SyntheticFashion()

"""

# What the quick start prints (each epoch's last loss), kept in a file: the workers' own
# stdout is not the test's. Defined in the module, so that it travels with the loop.
PRINT_TO_FILE = """
import builtins as _builtins
import os as _os


def print(*args, **kwargs):
    _builtins.print(*args, **kwargs)
    with open(_os.path.join(_PRINTS, f"{_os.getpid()}.txt"), "a") as _f:
        _f.write(" ".join(str(a) for a in args) + "\\n")
"""


def test_torch_quick_start(ray_local, tmp_path, monkeypatch):
    """The script's ``__main__`` as it is: ``train_func()`` in this process, then
    ``TorchTrainer(train_func_distributed, scaling_config=ScalingConfig(num_workers=4))``
    (no storage_path: Ray Train's ``~/ray_results``, here a temporary HOME)."""
    with open(os.path.join(EXAMPLES, "torch_quick_start.py")) as f:
        text = f.read()
    start = text.index("from torchvision import datasets")
    end = text.index("class NeuralNetwork")
    prints = tmp_path / "prints"
    prints.mkdir()
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    _example(
        "torch_quick_start.py",
        swaps={text[start:end]: SYNTHETIC_FASHION},
        preamble=f"_PRINTS = {str(prints)!r}\n{PRINT_TO_FILE}",
        main=True,
    )
    run_dir = _run_dir(str(tmp_path / "home" / "ray_results"))
    summary = _summary(run_dir)
    assert summary["status"] == "succeeded" and summary["failures"] == 0 and summary["steps"] == 0
    by_process = {}
    for name in os.listdir(prints):
        lines = (prints / name).read_text().splitlines()
        by_process[name] = [float(line.rsplit("loss: ", 1)[1]) for line in lines]
    # this process (the single-process train_func) and the 4 workers: 3 epochs each
    assert len(by_process) == 5 and all(len(v) == 3 for v in by_process.values()), by_process
    for losses in by_process.values():
        assert all(np.isfinite(losses)) and losses[-1] < losses[0], by_process


def _regression_csv(path: str, rows: int = 800) -> None:
    """The columns of Ray's ``regression.csv`` (``x000``..``x099``, ``y``): y a fixed linear
    function of x plus a little noise, and an offset of 5. The example's ``L1Loss`` broadcasts
    its ``(batch, 1)`` predictions against ``(batch,)`` targets, so what it learns is about a
    constant: around 0 its validation loss only wanders (0.7532, 0.7536, 0.7540 in one run),
    while from 0 towards 5 it falls every epoch."""
    import pandas as pd

    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, 100)).astype(np.float32)
    w = rng.normal(size=100).astype(np.float32) / 10
    frame = pd.DataFrame(x, columns=[f"x{i:03d}" for i in range(100)])
    frame["y"] = x @ w + 0.01 * rng.normal(size=rows) + 5.0
    frame.to_csv(path, index=False)


def test_torch_regression_example(ray_local, tmp_path, monkeypatch):
    """``train_regression(num_workers=2)``: Ray Datasets (split ``train``, whole
    ``validation`` through ``DataConfig(datasets_to_split=["train"])``),
    ``iter_torch_batches``, ``get_device``, ``model.module``; rank 0's validation loss goes
    down over the 3 epochs, a checkpoint each."""
    csv = str(tmp_path / "regression.csv")
    _regression_csv(csv)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    example = _example(
        "torch_regression_example.py", swaps={'"s3://anonymous@air-example-data/regression.csv"': repr(csv)}
    )
    result = example.train_regression(num_workers=2)
    assert result.error is None and set(result.metrics) == {"loss"}
    losses = [m["loss"] for m in result.metrics_history]
    assert len(losses) == 3 and losses[-1] < losses[0]
    run_dir = _run_dir(str(tmp_path / "home" / "ray_results"))
    assert result.path == run_dir
    assert _committed(run_dir) == ["checkpoint_000001", "checkpoint_000002", "checkpoint_000003"]
    assert result.checkpoint is not None and result.checkpoint.path.endswith("checkpoint_000003")
    with result.checkpoint.as_directory() as d:
        assert os.listdir(d) == ["model.pt"]
