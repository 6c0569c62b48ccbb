"""The controller's states: one small class each, carrying its own data
(``controller.py`` beside it moves between them)."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from elastic.errors import WorkerFailure

if TYPE_CHECKING:
    from elastic.control.stop import StopSignals

# --------------------------------------------------------------------------- states


class State:
    name = "state"
    is_terminal = False


@dataclass
class Starting(State):
    name = "starting"


@dataclass
class Running(State):
    name = "running"
    launched: bool = False


@dataclass
class Recovering(State):
    """``failed_at`` and ``detected_at`` are on the driver's monotonic clock: the last time
    the driver heard from a culprit (its last poll answer or step result), and the time
    the failure was diagnosed."""

    name = "recovering"
    failure: WorkerFailure
    detected_at: float
    last_seen_step: int
    failed_at: float


@dataclass
class Resizing(State):
    """A resize without a failure, to ``dp``: spawn replicas into ``groups`` and keep the
    members in ``keep`` (None: all). ``at_once``: do not wait for the step boundary (a
    drain too near its deadline). ``fields`` go into the ``resize`` event."""

    name = "resizing"
    reason: str
    dp: int
    groups: list[Any] = field(default_factory=list)
    keep: list[Any] | None = None
    at_once: bool = False
    fields: dict[str, Any] = field(default_factory=dict)
    ahead: list[Any] = field(default_factory=list)  # a grow-back's new members, started while the job trained
    not_started: WorkerFailure | None = None  # or why they did not start: met once the job has stopped


@dataclass
class Growing:
    """Not a state: a grow-back whose new workers are starting while the job trains on
    (``Controller._grow_check``), to ``dp`` with ``groups``; ``pending`` is the group's
    ``spawn_begin``."""

    dp: int
    groups: list[Any]
    pending: Any
    started: float


@dataclass
class Finished(State):
    name = "finished"
    is_terminal = True


@dataclass
class Failed(State):
    name = "failed"
    reason: str
    is_terminal = True


@dataclass
class Stopped(State):
    """The job was stopped on a signal (``elastic/control/stop.py``); ``fields`` go into
    ``job_end`` and ``summary.json``."""

    name = "stopped"
    is_terminal = True
    status = "stopped"
    fields: dict[str, Any] = field(default_factory=dict)


def stopped_state(signals: StopSignals, step: int, checkpoint_step: int | None, reason: str) -> Stopped:
    """How a stop on ``signals`` ended at ``step`` (``checkpoint_step``: the stop checkpoint
    committed, None: none, ``reason`` says why), said on stderr when nothing was saved."""
    fields = {"signal": signals.signal_name, "checkpoint_step": checkpoint_step, "stop_reason": reason}
    if checkpoint_step is None:
        print(f"stopped without a checkpoint of step {step}: {reason}", file=sys.stderr, flush=True)
    return Stopped(fields=fields)
