"""A Ray Train-style script on ``elastic.train``, as a user submits it with ``ray job submit
-- python tests/train/job_script.py --storage DIR`` (``tests/train/test_train_job_submit.py``):
two workers, a DDP model, a few reports, a checkpoint with the last one."""

from __future__ import annotations

import argparse
import os
import tempfile

import torch

import elastic.train as train
from elastic.train.torch import TorchTrainer


def loop(config):
    model = train.torch.prepare_model(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    y = x.sum(1, keepdim=True)
    for step in range(1, config["steps"] + 1):
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        metrics = {"loss": loss.item(), "step": step}
        if step == config["steps"]:
            with tempfile.TemporaryDirectory() as d:
                torch.save(getattr(model, "module", model).state_dict(), os.path.join(d, "model.pt"))
                train.report(metrics, checkpoint=train.Checkpoint.from_directory(d))
        else:
            train.report(metrics)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--storage", required=True)
    ap.add_argument("--name", default="submitted")
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    result = TorchTrainer(
        loop,
        train_loop_config={"steps": args.steps},
        scaling_config=train.ScalingConfig(num_workers=2),
        run_config=train.RunConfig(name=args.name, storage_path=args.storage),
    ).fit()
    import ray

    print(f"result: step {result.metrics['step']}, checkpoint {result.checkpoint.path}", flush=True)
    print(f"cluster: {ray.get_runtime_context().gcs_address}", flush=True)  # the one it joined
