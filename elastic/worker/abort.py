"""Leaving a step the driver abandoned (``TrainWorker.abort_step``: a peer was lost), and
saying whose failure ended a run (``classify``).

Runs in the worker, on its training thread. Without it a survivor would compute its step
to the end and learn of the loss only at its next collective, so the recovery would wait
for the rest of a step that grows with the model. Every block of the model, and every
module with parameters inside it (the linear layers: a block's matmuls are most of its
time), gets a forward pre-hook that raises ``StepAborted`` once the abort is set, and, in
that hook, a hook on the gradient of the module's input, so the backward (most of a step)
is left at the next layer too: the wait is one layer's compute, not one block's, which
grows with the model's width. A block's check runs before its parallel wrapper's own
pre-hooks (FSDP's all-gather of the block). Raising in either is safe: the step's
gradients are dropped by the next generation (``TrainEngine`` clears them when it adopts a
kept state), no optimizer step has begun, FSDP's unsharded stand-ins of an interrupted
block are not what is kept (``elastic/parallel/live.py``), and the DP wrapper that saw the
partial backward is replaced.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import sys
import threading
from collections.abc import Callable, Iterable
from typing import IO, Any

import torch

from elastic.errors import CorpusError, LoaderTimeout
from elastic.messages import RunOutcome
from elastic.worker.process_group import is_collective_error

logger = logging.getLogger(__name__)

# A survivor still in its step this long after the abort is stuck where neither the abort
# (checked between layers) nor the cut links (its connections to the lost ranks) reach: its
# stacks are logged and it cuts all of its own connections (it is leaving this generation
# anyway); the driver kills it if it is still there once its own wait for the survivors ends
# (``free_survivors``). Stalls of 18-30 s were seen 3 times in about 60 recoveries at 0.5 GB
# (DDP and HSDP, 2026-11-28); the one with a stack: the lost rank's HSDP shard partner blocked
# in FSDP's forward all-gather over their shard group, killed after 22.7 s.
STUCK_AFTER_ABORT_S = 5.0
# Still blocked in torch's distributed or autograd code this long after cutting all of its
# connections: nothing this process can do frees it (no peer will join a collective after the
# abort, and the cut did not fail it), and the driver would kill it once its own wait for the
# survivors ends (``survivors_wait_s``: 3 steps, 19.6 s at 0.5 GB in one HSDP recovery on
# 2026-11-29, where the lost rank's shard partner stayed in its forward all-gather and the cut
# found no connection to shut). The worker leaves the job at once instead (``leave``): the
# driver then counts it lost, as it would have after its wait, 3 steps sooner.
LEAVE_AFTER_CUT_S = 1.0
# Where a rank blocked on its peers is: a collective (c10d, FSDP, pipelining, DTensor) or a
# backward whose gradient hooks wait on one (DDP's reducer). A rank waiting for its data, or
# computing a layer, is in neither, and is left for the driver's wait.
BLOCKED_IN = (os.path.join("torch", "distributed", ""), os.path.join("torch", "autograd", ""))


class StepAborted(RuntimeError):
    """The driver abandoned the step in flight: a peer was lost (a collective's failure, not this rank's)."""


class AbortHooks:
    def __init__(self, abort: threading.Event, blocks: Iterable[torch.nn.Module]):
        self.abort = abort
        self._handles = []
        for block in blocks:
            self._handles.append(block.register_forward_pre_hook(self._check, prepend=True))
            self._handles.append(block.register_forward_pre_hook(self._forward))
            for layer in _layers(block):
                self._handles.append(layer.register_forward_pre_hook(self._forward))

    def _check(self, module: Any, args: Any) -> None:
        if self.abort.is_set():
            raise StepAborted("a peer was lost: the step is abandoned")

    def _forward(self, module: Any, args: Any) -> None:
        self._check(module, args)
        x = args[0] if args else None
        if isinstance(x, torch.Tensor) and x.requires_grad and torch.is_grad_enabled():
            x.register_hook(self._backward)

    def _backward(self, grad: Any) -> None:
        if self.abort.is_set():
            raise StepAborted("a peer was lost: the step is abandoned (in its backward)")

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def report_if_stuck(
    idle: threading.Event,
    after_s: float = STUCK_AFTER_ABORT_S,
    file: IO[str] | None = None,
    then: Callable[[], int] | None = None,
    leave: Callable[[], None] | None = None,
    leave_after_s: float = LEAVE_AFTER_CUT_S,
) -> threading.Thread | None:
    """After an abort: if the run in progress has not ended (``idle``) within ``after_s``,
    log every thread's stack once, to the worker's log (``file``: stderr), so that where a
    survivor was stuck is known even if the driver kills it, then call ``then`` (the worker:
    cut every connection of its group, which fails the collective it is blocked in; returns
    how many it cut). If the run is still in progress ``leave_after_s`` later with a thread
    blocked in a collective (``blocked_in_collective``), call ``leave`` (the worker: exit the
    process). No run in progress: nothing to watch (None)."""
    if idle.is_set():
        return None

    def watch() -> None:
        if idle.wait(after_s):
            return
        logger.warning("still in its step %.1fs after the abort; every thread's stack follows", after_s)
        faulthandler.dump_traceback(file=file or sys.stderr, all_threads=True)
        if then is not None:
            logger.warning("still in its step: %d connection(s) of its group cut", then())
        if leave is not None and not idle.wait(leave_after_s) and blocked_in_collective():
            logger.error(
                "still blocked in a collective %.1fs after cutting its connections: leaving the job "
                "(the driver counts this rank lost, as it would once its wait for the survivors ended)",
                leave_after_s,
            )
            leave()

    thread = threading.Thread(target=watch, name="abort-watch", daemon=True)
    thread.start()
    return thread


def leave_process() -> None:
    """Exit this worker's process now (``report_if_stuck``'s ``leave`` in a worker): its
    blocked train thread would keep it from ending any other way."""
    for stream in (sys.stderr, sys.stdout):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(1)


def blocked_in_collective() -> bool:
    """Whether a thread of this process other than the caller is inside torch's distributed
    or autograd code (``BLOCKED_IN``)."""
    me = threading.get_ident()
    for tid, frame in sys._current_frames().items():
        f = None if tid == me else frame
        while f is not None:
            if any(part in f.f_code.co_filename for part in BLOCKED_IN):
                return True
            f = f.f_back
    return False


def _layers(block: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules inside ``block`` that hold parameters of their own (linear layers, norms,
    embeddings), where a step can be left between two layers."""
    return [m for m in block.modules() if m is not block and any(True for _ in m.parameters(recurse=False))]


def classify(exc: Exception, step: int, blocked_s: float, collective_timeout_s: float) -> RunOutcome:
    """Whose failure ended a run: a collective's (a peer went away, or it timed out) or this
    rank's own. By exception type (``is_collective_error``) and by how long the failing call
    was blocked, never by message text."""
    detail = f"{type(exc).__name__}: {str(exc)[:300]}"
    if isinstance(exc, StepAborted):
        return RunOutcome("error", step, "peer", detail)
    if isinstance(exc, LoaderTimeout):
        return RunOutcome("error", step, "worker_error", detail, loader_wait_s=exc.waited_s)
    if not is_collective_error(exc):
        return RunOutcome("error", step, "worker_error", detail, retryable=not isinstance(exc, CorpusError))
    timed_out = blocked_s >= 0.9 * collective_timeout_s
    return RunOutcome("error", step, "timeout" if timed_out else "peer", detail)
