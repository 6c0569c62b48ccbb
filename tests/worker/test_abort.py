"""Leaving an abandoned step (elastic/worker/abort.py): at the next block, or the next layer
inside a block, of the forward or of the backward, and without changing the step's math
when nothing is abandoned."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from elastic.worker.abort import AbortHooks, StepAborted, report_if_stuck

pytestmark = pytest.mark.timeout(30)


def _blocks(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4)])


def _grads(model: nn.Module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def test_hooks_change_nothing_when_no_step_is_abandoned():
    x = torch.randn(3, 8)
    plain, hooked = _blocks(), _blocks()
    plain(x).sum().backward()
    AbortHooks(threading.Event(), list(hooked))
    hooked(x.requires_grad_()).sum().backward()
    for a, b in zip(_grads(plain), _grads(hooked)):
        assert a is not None and b is not None and torch.equal(a, b)


def test_an_abort_in_the_forward_leaves_at_the_next_block():
    model, abort = _blocks(), threading.Event()
    AbortHooks(abort, list(model))
    model[1].register_forward_hook(lambda *_: abort.set())  # the driver's abort arrives during block 1
    with pytest.raises(StepAborted):
        model(torch.randn(3, 8))


def test_an_abort_in_the_backward_leaves_at_the_next_block():
    """The abort arrives while the last block's backward runs: the gradient of its input is
    checked, so the backward stops there and the first blocks get no gradient."""
    model, abort = _blocks(), threading.Event()
    hooks = AbortHooks(abort, list(model))
    out = model(torch.randn(3, 8, requires_grad=True))
    out.register_hook(lambda g: abort.set())  # the first thing the backward does
    with pytest.raises(StepAborted, match="backward"):
        out.sum().backward()
    assert model[3][0].weight.grad is not None  # the block in flight finished
    assert all(p.grad is None for p in model[0].parameters())  # the backward never got here
    hooks.remove()
    abort.clear()
    model(torch.randn(3, 8)).sum().backward()  # removed: nothing raises any more


def _wide_blocks() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)) for _ in range(3)])


def test_an_abort_inside_a_block_leaves_at_its_next_layer():
    """A block's layers are checked too: the wait is one layer's compute, not one block's."""
    model, abort = _wide_blocks(), threading.Event()
    AbortHooks(abort, list(model))
    ran: list[int] = []
    model[1][0].register_forward_hook(lambda *_: abort.set())  # arrives during block 1's first layer
    model[1][2].register_forward_hook(lambda *_: ran.append(1))
    with pytest.raises(StepAborted):
        model(torch.randn(3, 8))
    assert ran == []  # block 1's second layer never ran

    model, abort = _wide_blocks(), threading.Event()
    AbortHooks(abort, list(model))
    out = model(torch.randn(3, 8, requires_grad=True))
    out.register_hook(lambda g: abort.set())  # the backward's first thing: the last layer's
    with pytest.raises(StepAborted, match="backward"):
        out.sum().backward()
    assert model[2][2].weight.grad is not None  # the layer in flight finished
    assert model[2][0].weight.grad is None  # the same block's first layer never got its gradient


def _parked_in_a_collective(release: threading.Event) -> None:
    release.wait(10)


def test_a_run_still_going_after_the_abort_logs_where_it_is_stuck(tmp_path):
    """A survivor that neither the abort nor the cut links free logs every thread's stack
    (the driver kills it later): the stuck thread's frame is named."""
    release, idle = threading.Event(), threading.Event()
    stuck = threading.Thread(target=_parked_in_a_collective, args=(release,))
    stuck.start()
    try:
        with open(tmp_path / "stacks", "w") as f:
            watch = report_if_stuck(idle, after_s=0.05, file=f)
            assert watch is not None
            watch.join(5)
        assert "_parked_in_a_collective" in (tmp_path / "stacks").read_text()
    finally:
        release.set()
        stuck.join(5)


def test_a_run_that_ends_in_time_logs_nothing(tmp_path):
    idle = threading.Event()
    with open(tmp_path / "stacks", "w") as f:
        watch = report_if_stuck(idle, after_s=5.0, file=f)
        assert watch is not None
        idle.set()  # the run ended
        watch.join(5)
    assert not watch.is_alive() and (tmp_path / "stacks").read_text() == ""


def test_a_run_stuck_outside_a_collective_is_left_to_the_driver(tmp_path):
    """Still in its step after the cut, but not blocked on its peers (waiting for its data, or
    computing a layer): ``leave`` is not called; the driver's wait decides."""
    release, idle = threading.Event(), threading.Event()
    waiting = threading.Thread(target=release.wait, args=(10,))
    waiting.start()
    left = []
    try:
        with open(tmp_path / "stacks", "w") as f:
            watch = report_if_stuck(idle, after_s=0.05, file=f, then=lambda: 0, leave=lambda: left.append(1),
                                    leave_after_s=0.05)  # fmt: skip
            assert watch is not None
            watch.join(5)
        assert not watch.is_alive() and left == []
    finally:
        release.set()
        waiting.join(5)
