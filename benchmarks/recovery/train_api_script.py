"""The user's training script of ``benchmarks/train_api_recovery.py``: one loop, written as a
Ray Train user writes it, run by Ray Train (``ray.train``) and by this platform
(``elastic.train``) alike. ``make_train_loop(train, train_torch)`` returns the
``train_loop_per_worker`` for one pair of modules; nothing else differs between the sides.

What the loop does, top to bottom:

- a small MLP on synthetic regression rows (generated from a seed in each worker), wrapped by
  ``prepare_model`` (DDP), AdamW, and ``prepare_optimizer`` when ``config["prepare_optimizer"]``
  (ours only: Ray Train's own ``prepare_optimizer`` is an AMP wrapper, and the Ray Train side
  runs without it);
- its rows from a map-style ``Dataset`` whose items carry their row id, through
  ``prepare_data_loader`` (``data: "loader"``), or from a Ray Dataset through
  ``get_dataset_shard("train").iter_torch_batches`` (``data: "dataset"``); each rank's batch is
  ``global_batch // world_size``, so the global batch stays the same at every size, and an
  epoch is ``rows // global_batch`` steps;
- ``report`` every step with ``{step, epoch, world_size, loss}``, and every
  ``checkpoint_every`` steps a checkpoint (``torch.save`` of model, optimizer, epoch and step
  into a temporary directory, ``Checkpoint.from_directory``, saved by rank 0);
- on entry it resumes from ``get_checkpoint()`` (state, epoch, step). It does not restore a
  data position: a Ray Train user has no way to (the sampler starts its epoch again);
- the rank ``hold_rank`` holds (sleeps ``hold_s``) once it has reported a step listed in
  ``hold_after`` at that group size: the benchmark kills its node there, so the kill lands
  after the same step on every side;
- each rank appends lines to its ledger, ``<ledger>/rank<r>-<pid>.jsonl`` (append mode,
  flushed): on entry an ``enter`` line (the resume step); before each step a ``batch`` line
  (the step it will be, the row ids, the rank and world size as ``get_context()`` says
  then); after it a ``step`` line (the loop's own step count, the group then, and whether
  ``optimizer.step()`` changed the weights: ``applied``, as ours holds back a step whose
  all-reduce failed). Every line has the wall time, the process, its node and its resident
  memory. The benchmark reads the ledgers (``train_api_ledger``).

Runs in the training workers of either side.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

FEATURES = 16
HIDDEN = 64


def synthetic_rows(rows: int, seed: int) -> tuple[Any, Any]:
    """``rows`` regression rows: x ~ N(0, 1) of ``FEATURES``, y a fixed linear map of x plus noise."""
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, FEATURES, generator=g)
    w = torch.randn(FEATURES, 1, generator=g)
    y = x @ w + 0.1 * torch.randn(rows, 1, generator=g)
    return x, y


def ray_dataset(rows: int, seed: int) -> Any:
    """The same rows as a Ray Dataset (columns ``x``, ``y``, ``row_id``), for ``data: "dataset"``."""
    import ray.data

    x, y = synthetic_rows(rows, seed)
    return ray.data.from_items(
        [{"x": x[i].numpy(), "y": y[i].numpy(), "row_id": i} for i in range(rows)], override_num_blocks=8
    )


class Ledger:
    """One rank's ledger file for one entry of the loop, appended to and flushed at every line;
    each line carries the time, the process, its node and its resident memory (MB)."""

    def __init__(self, directory: str, rank: int, node_id: str):
        import json

        self._dumps, self._node_id = json.dumps, node_id
        os.makedirs(directory, exist_ok=True)
        self._f = open(os.path.join(directory, f"rank{rank}-{os.getpid()}.jsonl"), "a")  # noqa: SIM115

    def write(self, **rec: Any) -> None:
        line = {"ts": time.time(), **rec, "pid": os.getpid(), "node_id": self._node_id, "rss_mb": _rss_mb()}
        self._f.write(self._dumps(line) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def make_train_loop(train: ModuleType, train_torch: ModuleType) -> Callable[[dict[str, Any]], None]:
    """The ``train_loop_per_worker`` on ``train`` (``ray.train`` or ``elastic.train``) and its
    ``torch`` module (``ray.train.torch`` or ``elastic.train.torch``)."""

    def train_loop_per_worker(config: dict[str, Any]) -> None:
        import ray
        import torch
        from torch import nn
        from torch.utils.data import DataLoader, Dataset

        torch.set_num_threads(1)
        ctx = train.get_context()
        rank, world = ctx.get_world_rank(), ctx.get_world_size()
        rows, global_batch = config["rows"], config["global_batch"]
        batch = global_batch // world
        steps_per_epoch = rows // global_batch
        total_steps = config["epochs"] * steps_per_epoch

        model = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU())
        model.append(nn.Linear(HIDDEN, 1))
        torch.manual_seed(config["seed"])
        for p in model.parameters():
            nn.init.normal_(p, std=0.1)
        model = train_torch.prepare_model(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=config["lr"])
        if config.get("prepare_optimizer"):
            optimizer = train_torch.prepare_optimizer(optimizer)

        step = 0
        checkpoint = train.get_checkpoint()
        if checkpoint is not None:
            with checkpoint.as_directory() as d:
                state = torch.load(os.path.join(d, "state.pt"), weights_only=False)
            unwrapped = model.module if hasattr(model, "module") else model
            unwrapped.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            step = int(state["step"])

        ledger = Ledger(config["ledger"], rank, ray.get_runtime_context().get_node_id())
        ledger.write(kind="enter", rank=rank, world_size=world, resume_step=step)

        if config["data"] == "loader":

            class Rows(Dataset):
                def __init__(self) -> None:
                    self.x, self.y = synthetic_rows(rows, config["seed"])

                def __len__(self) -> int:
                    return rows

                def __getitem__(self, i: int) -> tuple[Any, Any, int]:
                    return self.x[i], self.y[i], i

            loader = train_torch.prepare_data_loader(DataLoader(Rows(), batch_size=batch, shuffle=config["shuffle"]))

            def epoch_batches(epoch: int):
                if hasattr(loader, "sampler") and hasattr(loader.sampler, "set_epoch"):
                    loader.sampler.set_epoch(epoch)
                return iter(loader)
        else:
            shard = train.get_dataset_shard("train")

            def epoch_batches(epoch: int):
                for b in shard.iter_torch_batches(batch_size=batch):
                    yield b["x"], b["y"], b["row_id"]

        loss_fn = nn.MSELoss()
        try:
            while step < total_steps:
                epoch = step // steps_per_epoch
                trained = False
                for x, y, ids in epoch_batches(epoch):
                    # The group as it is now: a platform may resize it without entering the loop again.
                    now = train.get_context()
                    rank, world = now.get_world_rank(), now.get_world_size()
                    # The rows first: a rank killed after its gradients went into the all-reduce
                    # trained them, though it never gets to say so after the step.
                    ledger.write(
                        kind="batch", step=step + 1, epoch=epoch, rank=rank, world_size=world, rows=ids.tolist()
                    )
                    optimizer.zero_grad()
                    loss = loss_fn(model(x.float()), y.float().reshape(-1, 1))
                    loss.backward()
                    before = _probe(model).detach().clone()
                    held = optimizer.step() is False  # ours (prepare_optimizer): a failed step held back
                    # Whether this step changed the weights: a platform may hold a failed step back.
                    applied = not torch.equal(before, _probe(model).detach())
                    if held:  # its rows come again in the next batch: the loop does not count it
                        now = train.get_context()
                        ledger.write(
                            kind="step",
                            step=step + 1,
                            epoch=epoch,
                            rank=now.get_world_rank(),
                            world_size=now.get_world_size(),
                            applied=False,
                        )
                        continue
                    if config["step_sleep_s"]:
                        time.sleep(config["step_sleep_s"])  # a real step's compute, so the kill lands where asked
                    step += 1
                    trained = True
                    now = train.get_context()
                    rank, world = now.get_world_rank(), now.get_world_size()
                    ledger.write(kind="step", step=step, epoch=epoch, rank=rank, world_size=world, applied=applied)
                    metrics = {"step": step, "epoch": epoch, "world_size": world, "loss": float(loss)}
                    if step % config["checkpoint_every"] == 0:
                        _report_checkpoint(train, rank, model, optimizer, epoch, step, metrics)
                    else:
                        train.report(metrics)
                    if rank == config.get("hold_rank") and [world, step] in config.get("hold_after", []):
                        time.sleep(config["hold_s"])  # killed here: the peers wait in the next all-reduce
                    if step % steps_per_epoch == 0 or step >= total_steps:
                        break
                if not trained:  # a pass that yields nothing would spin: the data ran out
                    break
        finally:
            ledger.close()

    return train_loop_per_worker


def _probe(model: Any) -> Any:
    """The last layer's weight: AdamW changes it at every step it applies."""
    return list(model.parameters())[-2]


def _report_checkpoint(
    train: ModuleType, rank: int, model: Any, optimizer: Any, epoch: int, step: int, metrics: dict
) -> None:
    """``report`` from every rank, the checkpoint saved and attached by rank 0."""
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = None
        if rank == 0:
            unwrapped = model.module if hasattr(model, "module") else model
            state = {"model": unwrapped.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch, "step": step}
            torch.save(state, os.path.join(tmp, "state.pt"))
            checkpoint = train.Checkpoint.from_directory(tmp)
        train.report(metrics, checkpoint=checkpoint)
