"""The driver's record of a ``TorchTrainer`` run: the job it was given (``Job``), each loop
worker as the driver knows it (``Worker``: its actor, where it runs, what it last said), and
how what the workers reported becomes the run's error (``LoopFailed``, ``died_starting``,
``worker_exceptions``). Data, read and written by ``LoopDriver`` (``driver.py``) alone.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from elastic.train.callbacks import LoopCallbacks
from elastic.train.loop_messages import EntryOutcome, LoopError


class LoopFailed(RuntimeError):
    """The run ended without finishing: ``error`` is the cause (the loop's own exception when
    it raised one on every rank)."""

    def __init__(self, message: str, error: BaseException | None = None):
        super().__init__(message)
        self.error = error


@dataclass
class Worker:
    actor: Any
    info_ref: Any
    node_id: str = ""
    ip: str = ""
    pid: int = 0
    run_ref: Any = None
    poll_ref: Any = None
    outcome: EntryOutcome | None = None  # how its entry in progress ended (None: it runs)
    waiting: bool = False
    rss: list[int] = field(default_factory=list)  # resident bytes at each poll
    held: list[int] = field(default_factory=list)  # checkpoint parts in its memory at each poll
    generation: int = 0  # the generation it was last placed in
    entries: int = 0
    heard: float = 0.0  # the driver's clock at its last poll answer
    start_error: LoopError | None = None  # why it could not start the loop, if so
    resolved: bool = False  # its start answered: up (``node_id``) or failed


@dataclass
class Job:
    fn: Any
    config: dict[str, Any] | None
    min_workers: int
    max_workers: int
    resources: dict[str, float]
    use_gpu: bool
    placement_strategy: str
    max_failures: int
    num_to_keep: int | None
    score_attribute: str | None
    score_order: str
    name: str
    trial_name: str | None
    storage_dir: str
    run_dir: str
    datasets: dict[str, tuple[list[tuple[Any, int]], bool]]
    collective_timeout_s: float = 60.0
    callbacks: LoopCallbacks = field(default_factory=LoopCallbacks)


def died_starting(exc: BaseException) -> LoopError | None:
    """Why a worker died starting, when its own start raised (``actor_init_failed``: the
    same would happen again); None when it was lost (its node, its process)."""
    if not getattr(exc, "actor_init_failed", False):
        return None
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc))  # Ray colours the task's name
    return LoopError("error", f"{type(exc).__name__}: {text}", type(exc).__name__)


def exception_of(errors: list[EntryOutcome]) -> BaseException | None:
    first = errors[0].failure if errors else None
    return first.exception if first is not None else None


def worker_exceptions(members: list[Worker], lost: list[Worker], cause: str) -> dict[int, BaseException]:
    """World rank -> what that worker raised (its loop's exception, or why it is lost), as
    Ray Train's ``UserCallback.after_exception`` receives it."""
    out: dict[int, BaseException] = {}
    for rank, w in enumerate(members):
        o = w.outcome
        if w in lost:
            out[rank] = RuntimeError(f"worker lost: {o.error if o is not None and o.failure else cause}")
        elif o is not None and o.failure is not None and o.kind in ("error", "collective"):
            out[rank] = o.failure.exception or RuntimeError(o.error)
    return out
