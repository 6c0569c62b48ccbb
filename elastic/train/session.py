"""The running loop's view of its rank: ``report``, ``get_checkpoint``, ``get_context``,
``get_dataset_shard``, as Ray Train's, served by the rank runtime that entered the loop
(``LoopRank``, ``elastic/train/rank.py``), which sets this process's ``Session`` for each entry.

``report`` is where the platform may take the loop back: when the driver asked the rank
to leave this entry (a peer was lost, or the group grows at this boundary), ``report``
raises ``LoopExit`` after it has kept the report. A loop whose state the platform holds
(``prepare_optimizer``) does not leave for a lost peer: its next collective fails and the
step guard re-forms the group in place (``elastic/train/step_guard.py``). ``LoopExit`` is a ``BaseException``, so
a loop's ``except Exception`` does not swallow it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from elastic.train.checkpoint import Checkpoint


class LoopExit(BaseException):
    """The platform takes the loop back at a ``report`` (or a collective it cut)."""


@dataclass
class TrainContext:
    """What ``get_context()`` returns: this entry's place in the group."""

    world_size: int
    world_rank: int
    local_rank: int
    local_world_size: int
    node_rank: int
    experiment_name: str
    trial_name: str | None = None
    storage_path: str = ""

    def get_world_size(self) -> int:
        return self.world_size

    def get_world_rank(self) -> int:
        return self.world_rank

    def get_local_rank(self) -> int:
        return self.local_rank

    def get_local_world_size(self) -> int:
        return self.local_world_size

    def get_node_rank(self) -> int:
        return self.node_rank

    def get_experiment_name(self) -> str:
        return self.experiment_name

    def get_trial_name(self) -> str | None:
        return self.trial_name

    def get_storage(self) -> str:
        return self.storage_path


@dataclass
class Session:
    """One entry of the loop on one rank."""

    context: TrainContext
    checkpoint: Checkpoint | None
    on_report: Callable[[dict[str, Any], Checkpoint | None], None]
    shards: dict[str, Any] = field(default_factory=dict)
    device: Any = None
    exit: threading.Event = field(default_factory=threading.Event)  # a peer was lost (the driver's abort)
    leave: bool = False  # the group agreed to leave at the last report (it grows there)
    state: dict[str, Any] = field(default_factory=dict)  # what prepare_* registered (elastic/train/torch)

    def holds_step(self) -> bool:
        """The platform holds this loop's state (``prepare_optimizer``): a lost peer is
        recovered in its next collective, in place, not by leaving the loop."""
        guard = self.state.get("guard")
        return guard is not None and guard.active


_current: Session | None = None


def set_session(session: Session | None) -> None:
    global _current
    _current = session


def current() -> Session:
    if _current is None:
        raise RuntimeError("elastic.train: called outside a training loop (TorchTrainer.fit runs the loop)")
    return _current


def report(metrics: dict[str, Any], checkpoint: Checkpoint | None = None, **_: Any) -> None:
    """Report ``metrics`` (and a checkpoint of a local directory) for this step."""
    if not isinstance(metrics, dict):
        raise ValueError(f"report: metrics must be a dict, got {type(metrics).__name__}")
    if checkpoint is not None and not isinstance(checkpoint, Checkpoint):
        raise ValueError(f"report: checkpoint must be a Checkpoint, got {type(checkpoint).__name__}")
    session = current()
    session.on_report(metrics, checkpoint)
    if session.leave or (session.exit.is_set() and not session.holds_step()):
        raise LoopExit("the group is re-formed: the loop is entered again")


def get_checkpoint() -> Checkpoint | None:
    """The newest reported checkpoint when the loop was entered (None at a fresh start)."""
    return current().checkpoint


def get_context() -> TrainContext:
    return current().context


def get_dataset_shard(name: str) -> Any:
    """This rank's part of the dataset ``name`` passed to ``TorchTrainer(datasets=...)``."""
    shards = current().shards
    if name not in shards:
        raise KeyError(f"get_dataset_shard: no dataset {name!r} (datasets: {sorted(shards)})")
    return shards[name]
