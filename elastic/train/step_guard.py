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
kept in the rank runtime's memory tier (``elastic/checkpoint/memory_tier.py``, the built-in
trainer's): copied into preallocated buffers, reused step after step and entry after entry
(nothing allocated per step once the shapes are known), on a background thread (on CUDA a
side stream) that overlaps the loop's next forward and backward; the optimizer's next
``step`` waits for it before it changes the state. The two newest are kept (a survivor is at
most one step ahead of another); the state before an entry's first step, whose optimizer has
no state yet, is copied once by the guard itself. What a forward may change (the model's buffers: batch
norm's running statistics, DDP's buffer broadcast) is cloned before the copy starts; the
parameters and the optimizer's state are copied as they are, so a loop must change them
only in ``optimizer.step()`` (docs/train_api.md). No peer keeps a copy: under DDP every
survivor holds the whole state, the rule the built-in trainer applies
(``recovery_plan.replica_peers``: a state with an identical replica on another node needs
none).

What is not held: a collective the loop makes itself (``dist.all_reduce`` of a metric, a
DDP of its own) fails out of the loop, and the loop is entered again from the newest
checkpoint instead (docs/train_api.md says what a loop must do).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

from elastic.checkpoint.memory_tier import MemoryTier, Snapshot, unflatten_state
from elastic.checkpoint.snapshot import copy_plain, flatten_state
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
        self.tier: MemoryTier = rank.runtime.tier
        self._taken_as: dict[int, int] = {}  # step -> the rank its snapshot was taken as
        self._initial: Snapshot | None = None  # the state before the entry's first step (kept here)
        self.recoveries = 0
        clear_snapshots(self.tier)  # an earlier entry's: their buffers are reused

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
            self.tier.wait()  # the last snapshot's copy is done before the state changes
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
        self.tier.wait()  # the copy of this rank's newest step is done before the state is loaded over
        try:
            snap = self._initial if agreed == 0 else self.tier.get(self._taken_as[agreed], agreed)
            if snap is None:
                raise KeyError(agreed)
        except KeyError:
            raise RuntimeError(f"no snapshot of step {agreed} (this rank applied {self.applied})") from None
        self._load(snap)
        self.tier.discard_after(agreed)  # a step rolled back is not one to go back to
        self.applied = agreed
        self.recoveries += 1
        return kept

    def _device(self) -> torch.device | None:
        return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None

    def _snapshot(self) -> None:
        """Start the copy of the state after step ``applied`` (the module docstring)."""
        state: dict[str, Any] = {}
        for i, model in enumerate(self.models):
            buffers = {name for name, _ in model.named_buffers()}
            state[f"model{i}"] = {
                k: v.detach().clone() if k in buffers else v.detach() for k, v in model.state_dict().items()
            }
        for i, opt in enumerate(self.optimizers):
            sd = opt.state_dict()
            per_param = {str(k): v for k, v in sd["state"].items()}
            state[f"optimizer{i}"] = {"state": per_param, "groups": sd["param_groups"]}
        state["positions"] = [lo.position.as_dict() for lo in self.session.state["loaders"]]
        rank, world = self.session.context.world_rank, self.session.context.world_size
        if self.applied == 0:  # the optimizer has no state yet: another structure than every later step's
            tensors, objects = flatten_state(state)
            copies = {k: v.to("cpu", copy=True) for k, v in tensors.items()}
            self._initial = Snapshot(0, rank, copies, copy_plain(objects))
            return
        self.tier.snapshot_async(self.applied, rank, state, {"world": world})
        self._taken_as[self.applied] = rank
        for old in [k for k in self._taken_as if k < self.applied - 2]:
            del self._taken_as[old]
        if self.applied >= 2:
            self._initial = None  # every peer applied step 1 (none is more than a step behind)

    def _load(self, snap: Snapshot) -> None:
        state = unflatten_state({**snap.tensors, **snap.objects})
        for i, model in enumerate(self.models):
            model.load_state_dict(state[f"model{i}"])  # copied into the parameters
        for i, opt in enumerate(self.optimizers):
            saved = state[f"optimizer{i}"]
            # the optimizer keeps the tensors it is given (on the CPU): its own copies, not the tier's buffers
            per_param = {int(k): _clone(v) for k, v in saved.get("state", {}).items()}
            opt.load_state_dict({"state": per_param, "param_groups": saved["groups"]})
            opt.zero_grad(set_to_none=True)
        for loader, pos in zip(self.session.state["loaders"], state["positions"], strict=False):
            loader.restore(Position.from_dict(pos))


def clear_snapshots(tier: MemoryTier) -> None:
    """Forget the own snapshots ``tier`` holds (an earlier entry's), keeping their buffers."""
    try:
        tier.wait()
    except RuntimeError as exc:  # that copy's failure is the earlier entry's
        logger.info("an earlier entry's snapshot copy failed: %s", exc)
    tier.discard_after(-1)


def _done(buf: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(buf)
    return fut


def _clone(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clone(v) for v in obj]
    return obj
