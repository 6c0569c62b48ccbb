"""The step guard's snapshots (``elastic/train/step_guard.py``) in the rank runtime's memory
tier, held against the state itself: a snapshot is the state after its step, whatever the
loop does while its copy runs, and a load gives it back in full (model, buffers, optimizer).
In one process (the rollback on a real gloo group of one); the guard's recovery over a node loss is
``tests/train/test_train_loop.py``'s, against a replay of the run."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn

from elastic.checkpoint.memory_tier import MemoryTier
from elastic.train.session import Session, TrainContext
from elastic.train.step_guard import StepGuard

pytestmark = pytest.mark.timeout(60)


class HeldTier(MemoryTier):
    """A memory tier whose copies start only when ``go`` is set: a loop's forward runs
    while the copy of the step before is still to come."""

    def __init__(self) -> None:
        super().__init__("cpu")
        self.go = threading.Event()
        self.go.set()

    def _copy(self, buf, tensors, ready=None):  # type: ignore[no-untyped-def]
        assert self.go.wait(timeout=30)
        super()._copy(buf, tensors, ready)


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    path = tmp_path_factory.mktemp("pg") / "store"
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _guard(tier: MemoryTier) -> tuple[StepGuard, nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    rank = SimpleNamespace(runtime=SimpleNamespace(tier=tier), await_reform=lambda: None)
    session = Session(context=TrainContext(1, 0, 0, 1, 0, "t"), checkpoint=None, on_report=lambda *_: None)
    session.state["loaders"] = []
    guard = StepGuard(rank, session)
    guard.add_model(model)
    guard.add_optimizer(opt)
    return guard, model, opt


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(5, 6, generator=g), torch.randn(5, 1, generator=g)
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def _state(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    sd = opt.state_dict()
    return {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "opt": {k: {n: t.clone() for n, t in s.items()} for k, s in sd["state"].items()},
        "lr": [g["lr"] for g in sd["param_groups"]],
    }


def _assert_same(a: dict, b: dict) -> None:
    assert a["model"].keys() == b["model"].keys() and a["opt"].keys() == b["opt"].keys()
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    for k in a["opt"]:
        for n in a["opt"][k]:
            assert torch.equal(a["opt"][k][n], b["opt"][k][n]), (k, n)
    assert a["lr"] == b["lr"]


def test_a_snapshot_is_its_steps_state_while_the_next_forward_runs():
    """The copy of step 2 starts after the next forward has changed batch norm's running
    statistics (in place) and a third step is on its way: the snapshot still holds step 2's.
    Without the buffers' clone at the snapshot, it held the forward's statistics."""
    tier = HeldTier()
    guard, model, opt = _guard(tier)
    _train_step(model, opt, 1)
    tier.go.clear()  # step 2's snapshot copy waits: the next forward runs first
    _train_step(model, opt, 2)
    at_2 = _state(model, opt)
    model.train()(torch.randn(5, 6))  # changes the running statistics in place
    after_forward = _state(model, opt)
    tier.go.set()
    tier.wait()
    assert guard.applied == 2
    assert not torch.equal(at_2["model"]["1.running_mean"], after_forward["model"]["1.running_mean"])
    guard._load(tier.get(0, 2))
    _assert_same(_state(model, opt), at_2)


@pytest.mark.cluster  # a gloo group of one (the recovery's agreement is a collective)
def test_a_rollback_loads_the_step_and_the_optimizer_owns_what_it_loaded(group):
    """A recovery loads the agreed step's snapshot; the steps after it give the same state as
    the run that never rolled back (the optimizer's tensors are its own, not the tier's
    buffers, which later snapshots fill), and a second rollback to the same step still finds it."""
    guard, model, opt = _guard(MemoryTier("cpu"))
    for s in (1, 2, 3):
        _train_step(model, opt, s)
    after_3 = _state(model, opt)
    _train_step(model, opt, 4)
    guard.applied = 3  # as if the group agreed on step 3 (this rank applied 4)
    guard.recover()
    _assert_same(_state(model, opt), after_3)
    _train_step(model, opt, 4)
    again_4 = _state(model, opt)
    guard.applied = 3
    guard.recover()
    _assert_same(_state(model, opt), after_3)
    _train_step(model, opt, 4)
    _assert_same(_state(model, opt), again_4)
    assert guard.recoveries == 2


def test_a_new_entry_reuses_the_last_entrys_buffers():
    """The tier outlives the entry (it is the rank runtime's): an entry's guard forgets the
    last entry's snapshots and fills their buffers, allocating none for the same shapes."""
    tier = MemoryTier("cpu")
    guard, model, opt = _guard(tier)
    for s in (1, 2, 3):
        _train_step(model, opt, s)
    tier.wait()
    buffers = {id(t) for snap in tier._own + tier._free for t in snap.tensors.values()}
    guard, model, opt = _guard(tier)  # the next entry
    tier.wait()
    assert tier.steps() == []  # nothing of the last entry's (its state before step 1 is the guard's own)
    for s in (1, 2, 3):
        _train_step(model, opt, s)
    tier.wait()
    assert tier.steps() == [2, 3]
    now = {id(t) for snap in tier._own + tier._free for t in snap.tensors.values()}
    assert now <= buffers
