"""The controller's states: one small class each, carrying its own data, and the callback
protocol (``elastic/control/controller.py`` moves between them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from elastic.errors import WorkerFailure


class Callback(Protocol):
    """Typed lifecycle hook; every method is optional."""

    def on_step(self, step: int, group: Any) -> None: ...

    def on_reconfigure(self, recovery: int, group: Any, members: list[Any]) -> None:
        """Recovery number ``recovery`` chose ``members`` (in new rank order) and is about
        to re-rendezvous them."""


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
    name = "resizing"
    reason: str
    groups: list[Any] = field(default_factory=list)


@dataclass
class Finished(State):
    name = "finished"
    is_terminal = True


@dataclass
class Failed(State):
    name = "failed"
    reason: str
    is_terminal = True
