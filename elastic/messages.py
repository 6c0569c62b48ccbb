"""Every message between a worker and the controller, typed, in one place.

Workers produce ``WorkerReport``s (one per completed step, rolled-back step or checkpoint
upload); the controller reads them from ``PollReply``. The controller sends a
``ConfigureRequest`` to re-form the group, and ``run()`` answers with a ``RunOutcome``.
All are plain dataclasses: Ray pickles them, and tests build them directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

# --------------------------------------------------------------------------- worker -> controller


@dataclass(frozen=True)
class SnapshotReport:
    """A memory-tier snapshot that completed since the previous step."""

    step: int
    blocking_s: float  # what the training loop was held for
    duration_s: float  # the copy itself, mostly overlapped with compute
    bytes: int


@dataclass(frozen=True)
class StepReport:
    """One rank finished an optimizer step."""

    step: int
    loss: float
    grad_norm: float
    step_time_s: float
    batch_index: int
    peak_mem_bytes: int
    done_at: float  # the worker's wall clock; recorded as the step event's ``ts``, never compared
    data_wait_s: float = 0.0  # waiting for this step's batch
    compute_s: float = 0.0  # this rank's own forward, backward and optimizer step (waits for peers excluded)
    mfu: float | None = None
    snapshot: SnapshotReport | None = None


@dataclass(frozen=True)
class AnomalyReport:
    """A NaN or spiking loss: the rank rolled back in place instead of committing the step."""

    cause: Literal["nan_loss", "loss_spike"]
    step: int
    loss: float | None
    batch_index: int
    restored_step: int
    action: str


@dataclass(frozen=True)
class SdcReport:
    """An SDC check found twin replicas whose parameters differ: every rank rolled back to
    ``restored_step``, the last step whose check passed (see ``docs/health.md``)."""

    step: int
    ranks: tuple[int, ...]  # the odd ranks (without a majority: every rank of the disagreeing groups)
    replica: int | None  # the odd replica's DP rank; None when no majority decides, or several are odd
    decided: bool
    restored_step: int
    restore_s: float = 0.0


@dataclass(frozen=True)
class UploadReport:
    """A rank's part of a storage checkpoint (it may trail its step; see ``docs/checkpoints.md``)."""

    step: int
    rank: int
    gen: tuple[int, int]  # (the layout's base step, its world size): which group it belongs to
    layout: dict[str, int]
    result: dict[str, Any] | None  # ``RankWriteResult.to_dict()``; None on an error or a replay
    error: str | None
    blocking_s: float
    duration_s: float
    started_at: float
    bytes: int
    already_committed: bool = False


WorkerReport = StepReport | AnomalyReport | UploadReport | SdcReport


@dataclass(frozen=True)
class PollReply:
    """A heartbeat: the worker's progress counters and the reports produced since the last poll."""

    rank: int
    step: int
    phase: str
    idle_s: float
    reports: list[WorkerReport] = field(default_factory=list)


@dataclass(frozen=True)
class WorkerInfo:
    node_id: str
    ip: str
    pid: int


# --------------------------------------------------------------------------- controller -> worker


@dataclass(frozen=True)
class MemoryRestore:
    """Restore ``step`` from snapshots in memory: ``holders`` maps an old rank to the actor
    holding its snapshot, or None where this worker holds it itself."""

    step: int
    holders: dict[int, Any]


@dataclass(frozen=True)
class StorageRestore:
    """Restore ``step`` from the checkpoint under ``uri`` (staggered, see ``docs/checkpoints.md``)."""

    step: int
    uri: str
    storage_options: dict[str, Any] = field(default_factory=dict)


Restore = MemoryRestore | StorageRestore


@dataclass(frozen=True)
class ConfigureRequest:
    """Join generation ``generation`` of the group as ``rank`` and get ready to train from
    ``step``. ``store`` is the job's rendezvous store; ``replica_peer`` is the actor that
    keeps copies of this rank's snapshots (None: no peer copy)."""

    generation: int
    rank: int
    dims: tuple[int, int, int]  # (dp, tp, pp)
    store: tuple[str, int]
    step: int
    host_index: int
    restore: Restore | None = None
    storage_uri: str = ""
    replica_peer: Any = None
    read_plan: dict[str, Any] | None = None  # the host feeder this rank reads from (docs/data.md)
    store_secret: str = ""  # seals the job's keys in ``store`` (elastic/worker/job_store.py)
    # What this rank keeps from the layout it trained in (elastic/control/regroup.py):
    prior_rank: int | None = None  # its rank there (None: a newcomer)
    keep_state: bool = False  # its state there is its state here: it restores nothing if live at ``step``
    unchanged_groups: tuple[str, ...] = ()  # mesh dimensions whose group has the same members as before
    shrink_excluded: tuple[int, ...] | None = None  # the new group is the old one less these old ranks


@dataclass(frozen=True)
class ConfigureReply:
    rank: int
    step: int
    init_s: float
    build_s: float
    restore_s: float
    restore_bytes_read: int = 0
    store_ops: int = 0  # rendezvous store operations this rank made to join (group and mesh)
    kept_state: bool = False  # it resumed from its own live state and restored nothing
    peer_bytes: int = 0  # snapshot bytes it fetched from peers' memory
    cpu_s: float = 0.0  # CPU time the worker process spent configuring (every thread)


@dataclass(frozen=True)
class RunOutcome:
    """How ``run()`` ended.

    ``status``: ``done`` (reached the last step), ``stopped`` (an agreed stop at a step
    boundary), ``error``. For an error, ``kind`` says whose: ``worker_error`` (this rank's
    own), ``peer`` (a collective failed under it), ``timeout`` (a collective ran into
    ``elastic.collective_timeout_s``). ``retryable`` is False for an error that a retry would
    repeat (a ``CorpusError``): the job then fails at once.
    """

    status: Literal["done", "stopped", "error", "dead"]
    step: int = 0
    kind: Literal["worker_error", "peer", "timeout"] | None = None
    detail: str = ""
    retryable: bool = True


DEAD = RunOutcome("dead")  # the controller's own record of a run whose actor died
