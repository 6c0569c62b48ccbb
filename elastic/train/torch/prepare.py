"""``prepare_model``, ``prepare_data_loader``, ``prepare_optimizer`` and ``get_device``:
what a loop calls to hand the platform its model, data and optimizer (Ray Train's names;
``prepare_optimizer`` is ours).

- ``prepare_model(model)`` moves the model to the rank's device and, when the group has
  more than one rank, wraps it in ``DistributedDataParallel`` whose gradients are averaged
  by the step guard's hook (``elastic/train/step_guard.py``): the same all-reduce as DDP's
  own, which a lost peer cannot turn into a lost step when the optimizer is held too.
- ``prepare_data_loader(loader)`` gives this rank its share of the rows not yet trained in
  this epoch, whatever resizes happen (``elastic/train/data.py``), on the rank's device.
- ``prepare_optimizer(optimizer)`` lets the platform hold the optimizer (a snapshot after
  every step): with the two above, a node loss costs no step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import DataLoader

from elastic.train import session as _session
from elastic.train.data import ExactLoader
from elastic.train.step_guard import StepGuard


def get_device() -> torch.device:
    """The rank's device: its GPU with ``use_gpu``, else the CPU."""
    device = _session.current().device
    return device if device is not None else torch.device("cpu")


def get_devices() -> list[torch.device]:
    return [get_device()]


def _guard() -> StepGuard:
    s = _session.current()
    guard = s.state.get("guard")
    if guard is None:
        guard = s.state["guard"] = StepGuard(s.state["rank"], s)
    return guard


def prepare_model(
    model: torch.nn.Module,
    move_to_device: bool | torch.device = True,
    parallel_strategy: str | None = "ddp",
    parallel_strategy_kwargs: dict[str, Any] | None = None,
) -> torch.nn.Module:
    """The model on this rank's device, in DDP when the group has more than one rank."""
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"prepare_model: model must be a torch.nn.Module, got {type(model).__name__}")
    if parallel_strategy not in ("ddp", None):
        raise ValueError(f"prepare_model: parallel_strategy must be 'ddp' or None, got {parallel_strategy!r}")
    device = get_device() if move_to_device is True else move_to_device
    if device is not False:
        model = model.to(device)
    s = _session.current()
    guard = _guard()
    if parallel_strategy is None or s.context.world_size == 1:
        guard.add_model(model)
        return model
    kwargs = dict(parallel_strategy_kwargs or {})
    if device is not False and torch.device(device).type == "cuda":
        kwargs.setdefault("device_ids", [torch.device(device).index])
    ddp = torch.nn.parallel.DistributedDataParallel(model, **kwargs)
    ddp.register_comm_hook(
        None, lambda state, bucket: guard.comm_hook(state, bucket)
    )  # no annotations: DDP checks them
    guard.add_model(ddp)
    return ddp


def prepare_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Let the platform hold ``optimizer`` (ours): a lost peer then costs no step. Returns it."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"prepare_optimizer: a torch.optim.Optimizer, got {type(optimizer).__name__}")
    _guard().add_optimizer(optimizer)
    return optimizer


def prepare_data_loader(
    data_loader: DataLoader, add_dist_sampler: bool = True, move_to_device: bool = True, auto_transfer: bool = True
) -> ExactLoader | DataLoader:
    """This rank's share of the loader's rows not yet trained this epoch, on its device."""
    if not isinstance(data_loader, DataLoader):
        raise ValueError(f"prepare_data_loader: a torch.utils.data.DataLoader, got {type(data_loader).__name__}")
    s = _session.current()
    rank = s.state["rank"]
    device = get_device() if move_to_device else None
    whole: Callable[[], tuple[int, int]] = lambda: (0, 1)  # noqa: E731 - every rank reads it all
    loader = ExactLoader(data_loader, rank.current_group if add_dist_sampler else whole, lambda b: _to(b, device))
    loaders = s.state["loaders"]
    positions = s.state["positions"]
    if len(loaders) < len(positions):
        loader.restore(positions[len(loaders)])
    loaders.append(loader)
    return loader


def _to(batch: Any, device: torch.device | None) -> Any:
    if device is None or device.type == "cpu":
        return batch
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, dict):
        return {k: _to(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to(v, device) for v in batch)
    return batch
