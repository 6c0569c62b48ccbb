"""Zero lost steps for a user's loop that lets the platform hold its state: a model from
``prepare_model``, an optimizer from ``prepare_optimizer`` and loaders from
``prepare_data_loader`` / ``get_dataset_shard``.

How. The DDP model's gradients are averaged by a communication hook of ours (the same
all-reduce as DDP's default, over the current group). When a peer is lost during a step,
that all-reduce fails on the survivors (their sockets to the lost rank close, or the driver
cuts them: ``LoopRank.abort_step``); the hook swallows the failure and marks the step failed.
The optimizer's ``step`` then does not apply it: it waits for the driver's new group and
joins it in place (``LoopRank.await_reform``), the survivors agree on the newest step all
of them applied (a rank that had applied one more rolls back to its snapshot), the loaders
go back to that step's data position, and the loop goes on, without leaving its function:
its next batch is the failed step's rows re-cut at the new size. The report that follows a
failed step is dropped (``take_discarded``), so the job's steps stay the applied ones, and
that ``optimizer.step()`` returns ``False`` (an applied one returns what torch's does: None
without a closure), so a loop that counts its own steps (to end its epoch, say) can leave
the held one out: ``if optimizer.step() is False: continue`` (on Ray Train, never False).

The snapshots are the model's and optimizer's state in CPU memory after each applied step,
two deep (a survivor is at most one step ahead of another).

What is not held: a collective the loop makes itself (``dist.all_reduce`` of a metric, a
DDP of its own) fails out of the loop, and the loop is entered again from the newest
checkpoint instead (docs/train_api.md says what a loop must do).
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch
import torch.distributed as dist

from elastic.train.data import Position
from elastic.worker.process_group import is_collective_error

logger = logging.getLogger(__name__)


class StepGuard:
    """One entry's hold on its model, optimizer and loaders."""

    def __init__(self, rank: Any, session: Any):
        self.rank = rank
        self.session = session
        self.models: list[torch.nn.Module] = []
        self.optimizers: list[torch.optim.Optimizer] = []
        self.applied = 0
        self.failed = False
        self._discard = False
        self._snaps: dict[int, dict[str, Any]] = {}
        self.recoveries = 0

    @property
    def active(self) -> bool:
        return bool(self.optimizers)

    # ------------------------------------------------------------------ registration
    def add_model(self, model: torch.nn.Module) -> None:
        self.models.append(model)

    def add_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizers.append(optimizer)
        original = optimizer.step

        def step(*args: Any, **kwargs: Any) -> Any:
            if self.failed:
                self._failed_step()
                return False  # held back: a loop that counts its own steps does not count this one
            self._discard = False  # a held step's report, if the loop made none, is not the next one
            out = original(*args, **kwargs)
            self.applied += 1
            self._snapshot()
            return out

        optimizer.step = step  # type: ignore[method-assign]
        self._snapshot()

    # ------------------------------------------------------------------ the DDP hook
    def comm_hook(self, _state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """Average the bucket over the current group; a failure marks the step failed when
        the optimizer is held (else it fails the backward, as DDP's own hook would)."""
        buf = bucket.buffer()
        world = dist.get_world_size()
        if self.failed:
            return _done(buf)
        try:
            dist.all_reduce(buf)
        except Exception as exc:
            if not (self.active and is_collective_error(exc)):
                raise
            logger.info("a gradient all-reduce failed (%s): the step is not applied", exc)
            self.failed = True
            return _done(buf)
        buf.div_(world)
        return _done(buf)

    # ------------------------------------------------------------------ recovery
    def take_discarded(self) -> bool:
        discarded, self._discard = self._discard, False
        return discarded

    def _failed_step(self) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        self.recover()
        self._discard = True

    def recover(self) -> bool:
        """Join the new group, agree on the step to continue from, go back to it there.
        True when this rank kept its newest step (nothing rolled back)."""
        self.failed = False
        self.rank.await_reform()
        for model in self.models:
            if isinstance(model, torch.nn.parallel.DistributedDataParallel):
                model.process_group = dist.group.WORLD  # type: ignore[assignment]  # buffers are broadcast over the new group
        agreed = self.applied
        if dist.get_world_size() > 1:
            t = torch.tensor([self.applied], dtype=torch.int64, device=self._device())
            dist.all_reduce(t, op=dist.ReduceOp.MIN)
            agreed = int(t.item())
        kept = agreed == self.applied
        if agreed not in self._snaps:
            raise RuntimeError(f"no snapshot of step {agreed} (this rank applied {self.applied})")
        self._load(self._snaps[agreed])
        self.applied = agreed
        self.recoveries += 1
        return kept

    def _device(self) -> torch.device | None:
        return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None

    def _snapshot(self) -> None:
        snap = {
            "models": [{k: v.detach().to("cpu", copy=True) for k, v in m.state_dict().items()} for m in self.models],
            "optimizers": [_to_cpu(copy.deepcopy(o.state_dict())) for o in self.optimizers],
            "positions": [lo.position.as_dict() for lo in self.session.state["loaders"]],
        }
        self._snaps[self.applied] = snap
        for old in [k for k in self._snaps if k < self.applied - 1]:
            del self._snaps[old]

    def _load(self, snap: dict[str, Any]) -> None:
        for model, state in zip(self.models, snap["models"], strict=True):
            model.load_state_dict(state)
        for opt, state in zip(self.optimizers, snap["optimizers"], strict=True):
            opt.load_state_dict(state)
            opt.zero_grad(set_to_none=True)
        for loader, pos in zip(self.session.state["loaders"], snap["positions"], strict=False):
            loader.restore(Position.from_dict(pos))


def _done(buf: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(buf)
    return fut


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_cpu(v) for v in obj]
    return obj
