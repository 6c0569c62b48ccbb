"""Every message between a worker and the controller, typed, in one place.

Workers produce ``WorkerReport``s (one per completed step, rolled-back step or checkpoint
upload); the controller reads them from ``PollReply``. The controller sends a
``ConfigureRequest`` to re-form the group, and ``run()`` answers with a ``RunOutcome``.
All are plain dataclasses: Ray pickles them, and tests build them directly.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Protocol

Connection = tuple[str, int, str, int]  # a TCP link: (local host, local port, peer host, peer port)


def links_to(connections: Iterable[Connection]) -> frozenset[Connection]:
    """A rank's connections as its peers see them: the links to it that a survivor cuts."""
    return frozenset((ph, pp, lh, lp) for lh, lp, ph, pp in connections)


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


@dataclass(frozen=True)
class EvalReport:
    """The mean loss over the whole eval corpus (``data.eval_source``) after ``step``: every
    rank's is the same all-reduced value (``TrainEngine.eval_loss``)."""

    step: int
    eval_loss: float
    duration_s: float
    rows: int  # of the eval corpus


WorkerReport = StepReport | AnomalyReport | UploadReport | SdcReport | EvalReport


@dataclass(frozen=True)
class PollReply:
    """A heartbeat: the worker's progress counters and the reports produced since the last poll."""

    rank: int
    step: int
    phase: str
    idle_s: float
    reports: list[WorkerReport] = field(default_factory=list)
    outcome: RunOutcome | None = None  # how its last run() ended (None: running, or never run)
    runs: int = 0  # run() calls it started: ``outcome`` belongs to the last one
    first_seq: int = 0  # the number of ``reports[0]`` (they are consecutive)


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
    # Its group's TCP connections, (local host, local port, peer host, peer port) each (gloo):
    # when it is lost, the survivors cut their ends of these (``Signal.links``).
    connections: tuple[Connection, ...] = ()


@dataclass(frozen=True)
class RunOutcome:
    """How ``run()`` ended.

    ``status``: ``done`` (reached the last step), ``stopped`` (an agreed stop at a step
    boundary), ``error``. For an error, ``kind`` says whose: ``worker_error`` (this rank's
    own), ``peer`` (a collective failed under it), ``timeout`` (a collective ran into
    ``elastic.collective_timeout_s``). ``retryable`` is False for an error that a retry would
    repeat (a ``CorpusError``): the job then fails at once. ``loader_wait_s`` > 0: the error
    was this rank's data loader giving it no batch for that long (``LoaderTimeout``).
    """

    status: Literal["done", "stopped", "error", "dead"]
    step: int = 0
    kind: Literal["worker_error", "peer", "timeout"] | None = None
    detail: str = ""
    retryable: bool = True
    loader_wait_s: float = 0.0


DEAD = RunOutcome("dead")  # the controller's own record of a run whose actor died


# --------------------------------------------------------------------------- node agents <-> driver
# The driver talks to node agents (``elastic/agent/``), not to ranks: commands go down the
# agent tree, one per top-level channel, and what the ranks report comes back up merged, in
# ``Digest``s. See docs/architecture.md.


@dataclass(frozen=True, eq=False)
class StepRows:
    """Many ranks' ``StepReport``s of one step, column by column (numpy arrays, one row per
    rank): what a step costs the driver grows with its bytes, not with an object per rank.
    ``mfu`` is NaN where unknown; ``snap_step`` is -1 where no memory snapshot was reported."""

    step: int
    ranks: Any  # int64
    loss: Any
    grad_norm: Any
    step_time_s: Any
    data_wait_s: Any
    compute_s: Any
    peak_mem_bytes: Any  # int64
    done_at: Any
    mfu: Any
    snap_step: Any  # int64
    snap_blocking_s: Any
    snap_duration_s: Any
    snap_bytes: Any  # int64


@dataclass(frozen=True)
class RankNews:
    """A rank its agent has news of: its run() ended, it died, or its polls go unanswered.
    Durations are on the agent's clock (never a timestamp of another host)."""

    wid: int  # the worker's id, given by the driver at spawn
    step: int  # the newest step it reported completing
    outcome: RunOutcome | None = None  # how its run() ended, ``age_s`` ago
    dead: bool = False  # its actor died, ``age_s`` ago
    age_s: float = 0.0
    silent_s: float = 0.0  # how long its oldest unanswered poll is past due
    since: int = 0  # the command (configure or launch) its run belongs to: older outcomes are stale


@dataclass(frozen=True)
class NodeState:
    """A node with news: its ranks' count and newest step, and the ranks with news."""

    node: str
    ranks: int
    step: int
    news: tuple[RankNews, ...] = ()


@dataclass(frozen=True)
class CommandDone:
    """One node's answer to a command (``cid``): a reply per rank (a ``ConfigureReply``,
    snapshot holdings, a checkpoint's success), the ranks whose call raised (the root
    cause) and those whose actor died meanwhile. ``state``: the node's rank count and newest
    step as of the answer (its news come in ``Digest.states``)."""

    cid: int
    replies: dict[int, Any] = field(default_factory=dict)  # wid -> reply
    errors: dict[int, str] = field(default_factory=dict)  # wid -> error
    lost: tuple[int, ...] = ()
    state: NodeState | None = None
    node_faults: tuple[int, ...] = ()  # of ``errors``: the ranks whose node failed them (a full disk)


@dataclass(frozen=True)
class RankReport:
    """A rank's report other than a step's (an anomaly, an SDC check, a checkpoint upload);
    ``wid`` and ``seq`` (the worker's number for it) let the driver drop one sent twice."""

    rank: int
    report: WorkerReport
    wid: int = -1
    seq: int = 0


@dataclass(frozen=True, eq=False)
class Digest:
    """One answer of a channel of the agent tree (an agent, or an aggregator for its agents).

    ``seqs``: per node, the last of its items included (the driver acks them, and drops an
    item it has seen, by node and seq). ``rows``: step reports, one block per step, every
    node's ranks merged. ``items``: ``(node, seq, RankReport | CommandDone)`` in each node's
    order. ``states``: the nodes whose news changed since the last answer (a state without
    news: its news cleared); every node of the subtree after a ``resend``. ``lost``: the
    tree keys (node ids of agents, ``agg:...`` of aggregators) that cannot be reached, and
    for how long (``inf``: it died). ``step``: the newest step any rank of the subtree
    reported."""

    seqs: dict[str, int] = field(default_factory=dict)
    rows: list[StepRows] = field(default_factory=list)
    items: list[tuple[str, int, Any]] = field(default_factory=list)
    states: dict[str, NodeState] = field(default_factory=dict)
    lost: dict[str, float] = field(default_factory=dict)
    step: int = 0


# Commands: one part per node, sent down the tree as ``command(cid, {node: part})``.


@dataclass(frozen=True)
class Attach:
    """Watch these ranks: wid -> (actor handle, rank); ``since``: wid -> the command their
    current run belongs to (for an agent that replaces one lost mid-run)."""

    ranks: dict[int, tuple[Any, int]]
    since: dict[int, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Detach:
    """Stop watching these ranks (killed or gone); ``pids``: their processes on this node,
    which the agent ends at once (SIGKILL): a stopped or hung process is gone now, not when
    Ray gets to it, so its peers' collectives fail at once."""

    wids: tuple[int, ...]
    pids: tuple[int, ...] = ()


@dataclass(frozen=True)
class NodeConfigure:
    """Re-form this node's ranks: wid -> its request. Answered by one ``CommandDone``."""

    requests: dict[int, ConfigureRequest]


@dataclass(frozen=True)
class Launch:
    last_step: int


@dataclass(frozen=True)
class Signal:
    """A call every rank of the node gets, answered by no one: ``RequestStop``,
    ``AbortStep`` or ``AbandonRendezvous``."""

    call: RequestStop | AbortStep | AbandonRendezvous


@dataclass(frozen=True)
class Query:
    """A call to some ranks of the node, answered by one ``CommandDone``:
    ``SnapshotHoldings`` or ``SaveCheckpoint``."""

    call: SnapshotHoldings | SaveCheckpoint
    wids: tuple[int, ...] | None = None  # None: every rank of the node


@dataclass(frozen=True)
class Flush:
    """Every report these ranks produced so far comes up before the answer (one
    ``CommandDone``, which carries the node's state)."""

    wids: tuple[int, ...] | None = None  # None: every rank of the node


NodeCommand = Attach | Detach | NodeConfigure | Launch | Signal | Query | Flush


# --------------------------------------------------------------------------- agent -> rank
# What a node's agent asks of one of its ranks, each a type. ``method`` names the
# ``TrainWorker`` method that carries it and ``rank_call_args`` gives its arguments, as
# Ray sends them: on the wire a call is what it was, the method's own arguments.


@dataclass(frozen=True, slots=True)
class Poll:
    """Heartbeat and reports: back at once with news, else after ``wait_s``; ``ack``: the
    last report the driver has (the rank may drop it), ``have``: the last the agent has."""

    method: ClassVar[str] = "poll"
    wait_s: float
    ack: int
    have: int


@dataclass(frozen=True, slots=True)
class Reconfigure:
    """Re-form in place as the request says; answered with a ``ConfigureReply``."""

    method: ClassVar[str] = "reconfigure"
    req: ConfigureRequest


@dataclass(frozen=True, slots=True)
class Run:
    """Train up to ``last_step``; its end comes with a poll (``PollReply.outcome``)."""

    method: ClassVar[str] = "run"
    last_step: int


@dataclass(frozen=True, slots=True)
class RequestStop:
    """Stop at the next step boundary."""

    method: ClassVar[str] = "request_stop"


@dataclass(frozen=True, slots=True)
class AbortStep:
    """A peer was lost: leave ``generation``'s step in flight (0: whichever), and shut down
    these connections to the lost ranks, as the survivors see them."""

    method: ClassVar[str] = "abort_step"
    generation: int = 0
    links: frozenset[Connection] = frozenset()


@dataclass(frozen=True, slots=True)
class AbandonRendezvous:
    """The driver gave ``generation`` up: a rank still forming it fails at once."""

    method: ClassVar[str] = "abandon_rendezvous"
    generation: int


@dataclass(frozen=True, slots=True)
class SnapshotHoldings:
    """Owner rank -> the steps this rank can serve from memory; with ``after_run_s``, once
    its ``run()`` has ended, waiting that long at most."""

    method: ClassVar[str] = "snapshot_holdings"
    after_run_s: float = 0.0


@dataclass(frozen=True, slots=True)
class SaveCheckpoint:
    """Write a checkpoint of the current state, waiting ``timeout_s`` at most."""

    method: ClassVar[str] = "save_checkpoint"
    timeout_s: float


RankCall = Poll | Reconfigure | Run | RequestStop | AbortStep | AbandonRendezvous | SnapshotHoldings | SaveCheckpoint


def rank_call_args(call: RankCall) -> tuple[Any, ...]:
    """The call's fields in order: the arguments of ``TrainWorker.<call.method>``."""
    return tuple(getattr(call, name) for name in call.__match_args__)


class ReportSink(Protocol):
    """Where a rank's trainer and storage uploader put their reports (the worker's
    ``ReportQueue``; a deque in the single-rank harness)."""

    def append(self, item: Any) -> None: ...
