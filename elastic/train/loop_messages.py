"""What the driver of a ``TorchTrainer`` run (``LoopDriver``, ``driver.py``) and its loop
ranks (``LoopRank``, ``rank.py``) say to each other: one typed message per hop, as the
built-in trainer's ``elastic/messages.py`` is for ``elastic run``.

Driver -> rank (the ``train`` group): ``Entry`` (enter the loop at a ``Place`` of a
generation, from a ``Restore``); (the ``control`` group) a new ``Place`` for a rank waiting
in a held step (``reform``).

Rank -> driver: ``LoopInfo`` (where it runs, and whether the loop loaded there), a
``LoopPoll`` per poll (its ``LoopReport``\\ s and ``Upload``\\ s since the last one), and an
``EntryOutcome`` when an entry of the loop ends. An exception raised on a rank travels as a
``LoopError`` (its type, message, the loop's own traceback, and the exception where it
pickles).
"""

from __future__ import annotations

import pickle
import traceback
from dataclasses import dataclass, field
from typing import Any

from elastic.messages import WorkerInfo
from elastic.worker.process_group import is_collective_error

# --------------------------------------------------------------------------- driver -> rank


@dataclass
class Place:
    """A rank's place in one generation of the group."""

    generation: int
    rank: int
    world: int
    local_rank: int
    local_world: int
    node_rank: int
    store: tuple[str, int]
    secret: str
    peer: Any = None  # the actor that keeps a copy of this rank's checkpoints (another node's), or None


@dataclass
class Restore:
    """The checkpoint an entry starts from: report ``index``, whose files are in ``parts``
    (each part: the rank that reported them and the actors holding a copy), else in
    ``storage_dir`` (committed)."""

    index: int
    parts: list[tuple[int, list[Any]]]
    storage_dir: str | None
    positions: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Entry:
    """Enter the loop once, at ``place``, after report ``index``, from ``restore`` (None: a start)."""

    place: Place
    index: int  # the report this entry continues after
    restore: Restore | None
    experiment_name: str
    trial_name: str | None
    storage_dir: str  # where this run's checkpoints are uploaded
    run_id: str
    datasets: dict[str, tuple[list[tuple[Any, int]], bool]] = field(default_factory=dict)  # name -> (blocks, split)


# --------------------------------------------------------------------------- rank -> driver


@dataclass(frozen=True)
class LoopError:
    """An exception raised on a loop rank, as the driver hears it."""

    kind: str  # "collective" (a failed collective: a peer was lost) or "error" (the loop's own, or its start's)
    error: str  # "Type: message"
    type: str
    traceback: str = ""  # from the loop's own frame on
    exception: BaseException | None = None  # the exception itself, where it pickles
    node_id: str = ""  # where it was raised, when the loop could not start there

    @classmethod
    def of(cls, exc: BaseException, runtime_file: str = "") -> LoopError:
        """``exc`` as the driver hears it; frames of ``runtime_file`` (the rank's own) are left
        out of its traceback, so it begins at the loop's."""
        tb = exc.__traceback__
        while tb is not None and runtime_file and tb.tb_frame.f_code.co_filename == runtime_file:
            tb = tb.tb_next
        return cls(
            kind="collective" if is_collective_error(exc) else "error",
            error=f"{type(exc).__name__}: {exc}",
            type=type(exc).__name__,
            traceback="".join(traceback.format_exception(type(exc), exc, tb)),
            exception=_picklable(exc),
        )


@dataclass(frozen=True)
class LoopInfo(WorkerInfo):
    """Where a loop rank runs, its GPUs, and why the loop did not load there (None: it did)."""

    gpus: tuple[Any, ...] = ()
    load_error: LoopError | None = None


@dataclass(frozen=True)
class Restored:
    """How an entry's checkpoint was restored: from ``memory`` (the rank's own or a peer's) or ``storage``."""

    source: str
    duration_s: float


@dataclass(frozen=True)
class LoopReport:
    """One rank's ``report`` call, numbered by the job (``index``: its step)."""

    index: int
    rank: int
    generation: int  # the generation it was trained at
    world: int
    metrics: dict[str, Any]
    ts: float
    checkpoint: bool = False  # this rank reported checkpoint files (kept in memory, copied, uploading)
    positions: list[dict[str, Any]] = field(default_factory=list)  # each platform loader's data position
    rows: list[list[int]] = field(default_factory=list)  # each loader's rows of this step
    rows_served: int | None = None  # rows the platform's loaders served since the last report (None: none)
    blocking_s: float = 0.0  # the loop's wait in ``report``
    bytes: int = 0  # its checkpoint files' size
    restored: Restored | None = None  # this entry's restore, if it restored


@dataclass(frozen=True)
class Upload:
    """A checkpoint part's upload to storage: its ``manifest``, or the ``error`` it failed with."""

    index: int
    rank: int
    manifest: dict[str, Any] | None = None
    error: str | None = None


@dataclass(frozen=True)
class LoopPoll:
    """A poll's answer: what the rank reported and uploaded since the last poll, and its state."""

    reports: list[LoopReport]
    uploads: list[Upload]
    waiting: bool  # in a held step whose collective failed, waiting for a new place
    generation: int  # the generation it is placed in (a stale ``waiting`` is of an older one)
    rss: int  # resident bytes
    held: int = 0  # checkpoint parts it holds in memory (its own and its peers' copies)


@dataclass(frozen=True)
class EntryOutcome:
    """How one entry of the loop ended: ``finished`` (the loop returned ``value``), ``exited``
    (it left at a report, for the group to grow or re-form), ``error`` or ``collective``
    (``failure`` says what was raised), or ``lost`` (the driver's own: the actor is gone)."""

    kind: str
    index: int = 0  # the last report of the entry
    join_s: float = 0.0
    value: Any = None
    failure: LoopError | None = None

    @classmethod
    def raised(cls, failure: LoopError, index: int = 0, join_s: float = 0.0) -> EntryOutcome:
        return cls(failure.kind, index, join_s, failure=failure)

    @classmethod
    def lost(cls, error: str) -> EntryOutcome:
        return cls("lost", failure=LoopError("lost", error, "ActorDiedError"))

    @property
    def failed(self) -> bool:
        """The entry ended by a fault or an error: the driver recovers, or ends the run."""
        return self.kind in ("lost", "collective", "error")

    @property
    def error(self) -> str:
        return self.failure.error if self.failure is not None else self.kind


def _picklable(exc: BaseException) -> BaseException | None:
    try:
        pickle.loads(pickle.dumps(exc))
        return exc.with_traceback(None)
    except Exception:  # noqa: BLE001 - the driver rebuilds it from type and message
        return None


__all__ = [
    "Entry",
    "EntryOutcome",
    "LoopError",
    "LoopInfo",
    "LoopPoll",
    "LoopReport",
    "Place",
    "Restore",
    "Restored",
    "Upload",
]
