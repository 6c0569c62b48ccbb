"""Training loops the ``elastic.train`` tests run, and the one-process reference they are
held against: the same rows, batch by batch, replayed from the run's own ledger."""

from __future__ import annotations

import os
import tempfile
import time
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import elastic.train as train

ROWS = 192
FEATURES = 8


class Rows(Dataset):
    """Regression rows ``(id, x, y)``, the same in every process (a fixed seed)."""

    def __init__(self, n: int = ROWS):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, FEATURES, generator=g)
        self.y = self.x @ torch.linspace(-1, 1, FEATURES)[:, None] + 0.5

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        return i, self.x[i], self.y[i]


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(FEATURES, 1)


def loop(config: dict[str, Any]) -> dict[str, Any]:
    """A Ray Train-style loop: DataLoader, DDP model, SGD; a checkpoint every
    ``ckpt_every`` reports; resumes from ``get_checkpoint``; held with ``prepare_optimizer``
    when ``config["hold"]``. Writes its node id to ``config["nodes"]/rank<r>`` first."""
    ctx = train.get_context()
    with open(os.path.join(config["nodes"], f"rank{ctx.get_world_rank()}"), "w") as f:
        import ray

        f.write(ray.get_runtime_context().get_node_id())
    loader = train.torch.prepare_data_loader(DataLoader(Rows(), batch_size=config.get("batch", 4), shuffle=True))
    net = train.torch.prepare_model(model())
    opt = torch.optim.SGD(net.parameters(), lr=config.get("lr", 0.05))
    if config.get("hold"):
        opt = train.torch.prepare_optimizer(opt)
    epoch, step = 0, 0
    ckpt = train.get_checkpoint()
    if ckpt is not None:
        with ckpt.as_directory() as d:
            state = torch.load(os.path.join(d, "state.pt"))
        getattr(net, "module", net).load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        epoch, step = state["epoch"], state["step"]
    while epoch < config.get("epochs", 1):
        loader.sampler.set_epoch(epoch)
        for _, x, y in loader:
            loss = nn.functional.mse_loss(net(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            if config.get("fail_at") == step:
                raise ValueError(f"boom at step {step}")
            time.sleep(config.get("pace_s", 0.0))
            if step % config.get("ckpt_every", 5) == 0:
                with tempfile.TemporaryDirectory() as d:
                    torch.save(
                        {
                            "model": getattr(net, "module", net).state_dict(),
                            "opt": opt.state_dict(),
                            "epoch": epoch,
                            "step": step,
                        },
                        os.path.join(d, "state.pt"),
                    )
                    train.report({"loss": loss.item(), "step": step}, checkpoint=train.Checkpoint.from_directory(d))
            else:
                train.report({"loss": loss.item(), "step": step})
        epoch += 1
    return {k: v.detach().clone() for k, v in getattr(net, "module", net).state_dict().items()}


REPORTS = 6


def reporting_loop(config: dict[str, Any]) -> None:
    """``REPORTS`` reports of metrics that differ by rank, a checkpoint (one file per rank)
    with every third; ``config["fail"]``: raise on every rank instead."""
    rank = train.get_context().get_world_rank()
    if config.get("fail"):
        raise ValueError(f"boom on rank {rank}")
    for i in range(1, REPORTS + 1):
        metrics = {"loss": 1.0 / i + rank, "i": i, "rank": rank}
        if i % 3 == 0:
            with tempfile.TemporaryDirectory() as d:
                torch.save({"i": i}, os.path.join(d, f"part{rank}.pt"))
                train.report(metrics, checkpoint=train.Checkpoint.from_directory(d))
        else:
            train.report(metrics)


def checkpointing_loop(config: dict[str, Any]) -> None:
    """``config["reports"]`` reports ``pace_s`` apart, each with a checkpoint (one file per rank)."""
    rank = train.get_context().get_world_rank()
    for i in range(1, config["reports"] + 1):
        time.sleep(config.get("pace_s", 0.0))
        with tempfile.TemporaryDirectory() as d:
            with open(os.path.join(d, f"part{rank}.txt"), "w") as f:
                f.write(str(i))
            train.report({"i": i}, checkpoint=train.Checkpoint.from_directory(d))


def lineage(ledger: list[dict[str, Any]], full: bool = False) -> dict[int, Any]:
    """Each step's reports from the newest generation that reported it: rank -> rows of its
    first loader (``full``: rank -> the whole ledger entry)."""
    newest: dict[int, int] = {}
    for e in ledger:
        newest[e["index"]] = max(newest.get(e["index"], 0), e["generation"])
    steps: dict[int, dict[int, Any]] = {}
    for e in ledger:
        if e["generation"] == newest[e["index"]]:
            steps.setdefault(e["index"], {})[e["rank"]] = e if full else e["rows"][0]
    return {i: steps[i] for i in sorted(steps)}


def replay(steps: dict[int, list[list[int]]], lr: float = 0.05) -> dict[str, torch.Tensor]:
    """One process, the same batches: the mean over ranks of each rank's mean loss (DDP's)."""
    data, net = Rows(), model()
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    for i in sorted(steps):
        losses = [nn.functional.mse_loss(net(data.x[ids]), data.y[ids]) for ids in steps[i]]
        opt.zero_grad()
        (sum(losses) / len(losses)).backward()
        opt.step()
    return net.state_dict()


def removing_loop(config: dict[str, Any]) -> None:
    """``config["reports"]`` reports ``pace_s`` apart; rank 0 removes ``config["run_dir"]``
    (the run's own files) after the ``remove_at``-th."""
    rank = train.get_context().get_world_rank()
    for i in range(1, config["reports"] + 1):
        train.report({"loss": 1.0, "i": i})
        if rank == 0 and i == config["remove_at"]:
            import shutil

            shutil.rmtree(config["run_dir"])
        time.sleep(config["pace_s"])
