"""A ``TorchTrainer`` as a Ray Tune trainable: ``ray.tune.Tuner(trainer, param_space=
{"train_loop_config": {...}})`` runs each trial as its own elastic fit, and each trial's
final metrics reach the ``ResultGrid``. Two trials of one worker each, on ``ray_local``.

The loop is gradient descent on ``(w - 3)^2`` from ``w = 0``, so each trial's loss after
``n`` steps at rate ``lr`` is known in closed form: ``9 (1 - 2 lr)^(2n)``.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import ray.cloudpickle
import torch

import elastic.train as train
from elastic.train.torch import TorchTrainer

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

STEPS = 4

# pytest imports this file as a top-level module the workers cannot import: its loop goes to
# them by value, as a script's ``__main__`` does.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def loop(config):
    w = torch.zeros(1, requires_grad=True)
    opt = torch.optim.SGD([w], lr=config["lr"])
    for step in range(1, config["steps"] + 1):
        opt.zero_grad()
        ((w - 3) ** 2).sum().backward()
        opt.step()
        loss = ((w.detach() - 3) ** 2).item()
        train.report({"loss": loss, "step": step, "lr": config["lr"]})


def _expected(lr: float, steps: int) -> float:
    return 9 * (1 - 2 * lr) ** (2 * steps)


def test_a_tuner_runs_each_trial_as_an_elastic_fit(ray_local, tmp_path):
    from ray import tune

    runs = tmp_path / "runs"
    trainer = TorchTrainer(
        loop,
        train_loop_config={"steps": STEPS},
        scaling_config=train.ScalingConfig(num_workers=1),
        run_config=train.RunConfig(name="sweep", storage_path=str(runs)),
    )
    tuner = tune.Tuner(
        trainer,
        param_space={"train_loop_config": {"lr": tune.grid_search([0.05, 0.2])}},
        tune_config=tune.TuneConfig(metric="loss", mode="min", max_concurrent_trials=2),
        run_config=tune.RunConfig(name="tune", storage_path=str(tmp_path / "tune")),
    )
    grid = tuner.fit()
    assert len(grid) == 2 and not grid.errors, grid.errors
    by_lr = {}
    for result in grid:
        lr = result.config["train_loop_config"]["lr"]
        assert result.metrics["step"] == STEPS and result.metrics["lr"] == lr
        by_lr[lr] = result.metrics["loss"]
    assert sorted(by_lr) == [0.05, 0.2]
    for lr, loss in by_lr.items():
        assert loss == pytest.approx(_expected(lr, STEPS), rel=1e-6)
    best = grid.get_best_result()
    assert best.config["train_loop_config"]["lr"] == 0.2
    # each trial is an elastic run of its own, with its run files, under the trainer's storage
    trial_runs = sorted(os.listdir(runs))
    assert len(trial_runs) == 2 and all(r.startswith("sweep_") for r in trial_runs), trial_runs
    for name in trial_runs:
        with open(runs / name / "summary.json") as f:
            summary = json.load(f)
        assert summary["status"] == "succeeded" and summary["steps"] == STEPS


def test_a_trial_reserves_its_driver_and_max_workers_and_refuses_unknown_keys():
    trainer = TorchTrainer(loop, scaling_config=train.ScalingConfig(num_workers=(1, 3)))
    pgf = trainer._resources({"train_loop_config": {"lr": 0.1}})
    assert pgf.bundles == [{"CPU": 1.0}] + [{"CPU": 1.0}] * 3
    wider = trainer._resources({"scaling_config": train.ScalingConfig(num_workers=2, resources_per_worker={"CPU": 2})})
    assert wider.bundles == [{"CPU": 1.0}, {"CPU": 2.0}, {"CPU": 2.0}]
    with pytest.raises(train.TrainConfigError, match=r"^param_space\['lr'\]: a TorchTrainer trial takes"):
        trainer._resources({"lr": 0.1})
    with pytest.raises(train.TrainConfigError, match=r"^param_space\['scaling_config'\]"):
        trainer._resources({"scaling_config": {"num_workers": 2}})
