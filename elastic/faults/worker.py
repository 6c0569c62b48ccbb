"""Faults injected inside a worker (they run in the rank's process, at the start of a step).

``WorkerFaults`` is a ``StepHook`` (``elastic/worker/hooks.py``): corrupt the weights with
NaN (silent data corruption), blow a weight up (a loss spike), flip one bit, raise inside
the step, or hang the training thread (a collective that never completes for its peers).
Each of these fires once per job, so the replayed step after a recovery runs clean: a
worker added later gets no faults, and a survivor renumbered onto the faulted rank drops a
fault whose step it had begun before (it replays that step). One given ``below_dp`` waits
for the first step from its ``step`` on that the run takes with fewer replicas than that,
replayed or not, and fires there in the worker that is ``rank`` then (a failure inside the
first step after a shrink).
``slow`` makes the worker that is ``rank`` at ``step`` a straggler for every step from then
on (it stays with that worker when a resize renumbers the ranks). ``hold`` (a test's
condition, not a fault) keeps a rank from starting a step while the run is below
``below_dp`` replicas and the file ``marker`` exists, until the controller asks the group
to stop (to resize) or ``seconds`` pass; it keeps the heartbeat going meanwhile. A test that
must see the group grow back before the run ends waits on this condition instead of racing
a timer. ``late`` (a test's condition too) makes the worker that is ``rank`` in generation
``step`` of the group (1: the job's start) join that rendezvous ``seconds`` late: its peers'
rendezvous times out first when ``seconds`` is longer than theirs.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

# ``hold`` and ``late`` are a test's conditions, not failures: ``--fault`` does not offer them.
WORKER_FAULT_KINDS = ("nan", "spike", "raise", "hang", "slow", "bitflip", "hold", "late")
_EVERY_STEP = ("slow", "hold")  # from ``step`` on, not once
_NOT_A_STEP = (*_EVERY_STEP, "late")  # not one-shot faults of a step (``late``: of a rendezvous)


class InjectedError(RuntimeError):
    """The exception a ``raise`` fault throws inside a training step."""


def worker_fault(
    kind: str, step: int, rank: int = 0, seconds: float = 0.0, bit: int = 30, **extra: Any
) -> dict[str, Any]:
    """``bit``: the bit a ``bitflip`` flips; ``extra``: ``hold`` takes ``marker`` (a file path) and ``below_dp``;
    a one-shot fault may take ``below_dp`` (it fires only while the run has fewer replicas)."""
    if kind not in WORKER_FAULT_KINDS:
        raise ValueError(f"unknown worker fault {kind!r}; expected one of {WORKER_FAULT_KINDS}")
    if kind == "hold" and set(extra) != {"marker", "below_dp"}:
        raise ValueError("a hold needs marker= and below_dp=")
    if kind not in _EVERY_STEP and not set(extra) <= {"below_dp"}:
        raise ValueError(f"a {kind} fault takes below_dp= only, not {sorted(set(extra) - {'below_dp'})}")
    return {"kind": kind, "step": step, "rank": rank, "seconds": seconds, "bit": bit, **extra}


class WorkerFaults:
    """Faults injected inside the workers' steps: a ``StepHook`` (``elastic/worker/hooks.py``).

    Give it to a job as ``ElasticTrainer(spec, step_hook=WorkerFaults([...]))``; the list
    comes from :func:`worker_fault` or from ``--fault`` (:func:`build_faults`).
    """

    def __init__(self, faults: list[dict[str, Any]]):
        self._pending = list(faults)
        self._last_step = 0  # the latest step this worker began: a step again is a replay
        # Set in the worker by ``attach`` (the hook travels there pickled, without them).
        self._stop: threading.Event | None = None  # the worker's "stop at the next step boundary"
        self._beat: Callable[[], None] | None = None  # the worker's heartbeat

    def attach(self, stop: threading.Event, beat: Callable[[], None]) -> None:
        self._stop, self._beat = stop, beat

    def pending(self, step: int, rank: int) -> bool:
        """A one-shot fault may be due now (the worker then waits for its last snapshot)."""
        return any(
            f["rank"] == rank
            and f["kind"] not in _NOT_A_STEP
            and (f["step"] <= step if "below_dp" in f else f["step"] == step)
            for f in self._pending
        )

    def before_step(self, step: int, rank: int, engine: Any) -> None:
        for fault in self._pending:
            if fault["kind"] == "slow" and step >= fault["step"]:
                # A slow device stays with its worker: decided once, by the rank this worker
                # has at its first step from ``step`` on (ranks are renumbered by a resize).
                if fault.setdefault("_here", fault["rank"] == rank):
                    _slow_forward(engine, fault["seconds"])  # a straggler: every step from then on
            if fault["kind"] == "hold" and step >= fault["step"] and fault["rank"] == rank:
                self._hold(fault, engine)
        replay, self._last_step = step <= self._last_step, max(self._last_step, step)
        for fault in list(self._pending):
            if fault["kind"] in _NOT_A_STEP:
                continue
            if "below_dp" in fault:  # due at the first step from ``step`` on in a smaller run, replayed or not
                if engine.dims.dp >= fault["below_dp"] or step < fault["step"]:
                    continue
                self._pending.remove(fault)  # in every worker: it fires once, in the one that is ``rank`` now
                if fault["rank"] != rank:
                    continue
            elif replay and fault["step"] <= step:  # the replayed step runs clean, whatever rank this worker has now
                self._pending.remove(fault)
                continue
            elif fault["step"] != step or fault["rank"] != rank:
                continue
            else:
                self._pending.remove(fault)
            kind = fault["kind"]
            if kind == "raise":
                raise InjectedError(f"injected failure in step {step} on rank {rank}")
            if kind == "hang":
                time.sleep(fault["seconds"])
            elif kind in ("nan", "spike", "bitflip"):
                import torch

                with torch.no_grad():
                    # The output head (the last matrix): scaling it is a sure loss spike.
                    param = [p for p in engine.model.parameters() if p.dim() >= 2][-1]
                    local = param.to_local() if hasattr(param, "to_local") else param
                    if kind == "nan":
                        local.fill_(float("nan"))
                    elif kind == "spike":
                        local.mul_(60.0)
                    else:
                        flip_bit(local, fault.get("bit", 30))

    def before_join(self, generation: int, rank: int) -> None:
        for fault in list(self._pending):
            if fault["kind"] == "late" and fault["step"] == generation and fault["rank"] == rank:
                self._pending.remove(fault)
                time.sleep(fault["seconds"])

    def _hold(self, fault: dict[str, Any], engine: Any) -> None:
        deadline = time.monotonic() + fault["seconds"]
        stop = self._stop or threading.Event()
        while (
            engine.dims.dp < fault["below_dp"]
            and os.path.exists(fault["marker"])
            and not stop.is_set()
            and time.monotonic() < deadline
        ):
            if self._beat is not None:
                self._beat()
            stop.wait(0.05)


def _slow_forward(engine: Any, seconds: float) -> None:
    """Make this rank's forward passes need ``seconds`` more work per step, like a slower
    device: a busy loop on the training thread (its CPU time, which is what a CPU rank's own
    compute measures; on an idle core, the same in wall time), before the rank joins the
    gradient sync. Installed once per module (a new layout builds a new one, or keeps a
    survivor's module, which then has it already: elastic/parallel/live.py)."""
    module = engine.module
    module._slow_per_micro_batch = seconds / max(1, getattr(engine, "grad_accum", 1))  # this layout's
    if getattr(module, "_injected_slow", None) == seconds:
        return

    def burn(m: Any, args: Any) -> None:
        end = time.thread_time() + m._slow_per_micro_batch
        while time.thread_time() < end:
            pass

    module.register_forward_pre_hook(burn)
    module._injected_slow = seconds


def flip_bit(tensor: Any, bit: int, index: int = 0) -> None:
    """Flip bit ``bit`` of element ``index`` of a tensor in place: silent data corruption on
    one rank (bit 30 of a float32 is the top exponent bit: a small weight becomes ~1e38)."""
    import torch

    flat = tensor.view(-1)
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
    word = flat[index : index + 1].view(ints)
    word.bitwise_xor_(torch.tensor(1 << bit, dtype=torch.int64).to(ints))
