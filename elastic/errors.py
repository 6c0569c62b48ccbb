"""One typed exception hierarchy for the whole runtime.

Policies and the controller switch on these types, never on message text.
"""

from __future__ import annotations

from typing import Any


class ElasticError(Exception):
    """Base of every error raised on purpose by this project."""


class SpecError(ElasticError):
    """Invalid user input. ``field`` is the dotted spec key at fault (exit code 2)."""

    def __init__(self, field: str, message: str):
        self.field = field
        self.message = message
        hidden = sorted({f"U+{ord(c):04X}" for c in field if not c.isprintable()})
        if hidden:  # a zero-width space in a key printed as an invisible difference
            message = f"{message} (the key holds invisible characters: {', '.join(hidden)})"
        super().__init__(f"{_visible(field)}: {message}" if field else message)


def _visible(text: str) -> str:
    """``text`` with every character that prints as nothing (or as a control) escaped: ``\\u200b``."""
    return "".join(c if c.isprintable() else f"\\u{ord(c):04x}" for c in text)


class InfeasibleError(SpecError):
    """The request cannot be placed on the given topology or cluster (exit code 2)."""


class JobFailed(ElasticError):
    """The job ended without finishing its steps (exit code 1)."""


class CorpusError(ElasticError):
    """Training data that every read returns the same way (rows of the wrong length, token
    ids outside the vocabulary): raised by a rank as it reads, it ends the job at once,
    since a retry would only repeat it (``NotRetryable``)."""


class LoaderTimeout(ElasticError, TimeoutError):
    """Raised by a rank whose data loader gave it no batch within its bound (a hanging read:
    storage that accepts and never answers, a stuck host reader). ``loader`` names it and
    ``host`` where it ran; ``waited_s`` is how long the rank waited."""

    def __init__(self, loader: str, host: str, dp_rank: int, batch: int, waited_s: float, why: str = ""):
        self.loader, self.host, self.dp_rank, self.batch, self.waited_s = loader, host, dp_rank, batch, waited_s
        more = f" ({why})" if why else ""
        super().__init__(
            f"the {loader} loader on {host} gave dp rank {dp_rank} no batch {batch} within {waited_s:g}s{more}"
        )


# ----- failures seen while training: each maps to one `failure.cause` (docs/outputs.md) -----
# A NaN or spiking loss is not an exception: the workers roll back in place and report an
# ``AnomalyReport`` (elastic/messages.py) whose cause is ``nan_loss`` or ``loss_spike``.


class WorkerFailure(ElasticError):
    """A failure of one or more ranks observed while training."""

    cause: str = "worker_error"
    retryable: bool = True  # False: a re-formation would meet the same error (NotRetryable)
    # While the group starts: True for a failure of the machines, not of the training code
    # (a lost node or actor, a rendezvous that did not form): the start begins again.
    starts_again: bool = True
    node_fault: bool = False  # the node's own fault: counted against it whatever the cause (lemon nodes)

    def __init__(self, detail: str, ranks: list[int] | None = None, nodes: list[str] | None = None):
        self.detail = detail
        self.ranks = sorted(ranks or [])
        self.nodes = sorted(nodes or [])
        self.unanswered: list[int] = []  # a configure's ranks that never answered it (maybe stuck in it)
        self.store_denied: dict | None = None  # connections the rendezvous store refused meanwhile
        super().__init__(detail)

    def note_store_denials(self, denials: dict | None) -> None:
        """The rendezvous store refused connections without the job's secret while this
        failure happened (``RendezvousStore.take_denials``): outside interference, named in
        the ``failure`` event (``store_denied``) and its detail. It still counts against
        ``elastic.max_failures`` (a job that retried for free could be kept re-forming for
        ever), but never silently."""
        if not denials:
            return
        self.store_denied = denials
        peers = ", ".join(denials["peers"])
        self.detail += (
            f" (meanwhile the rendezvous store refused {denials['connections']} connection(s) from outside the "
            f"job, from {peers}: {', '.join(sorted(denials['reasons']))}; counted against elastic.max_failures)"
        )
        self.args = (self.detail,)


class ActorDied(WorkerFailure):
    cause = "actor_died"


class NodeLost(WorkerFailure):
    cause = "node_lost"


class HeartbeatTimeout(WorkerFailure):
    cause = "heartbeat_timeout"


class CollectiveTimeout(WorkerFailure):
    cause = "collective_timeout"


class WorkerError(WorkerFailure):
    cause = "worker_error"
    starts_again = False  # the training code's own error at start-up: a new start would repeat it


class RendezvousFailed(WorkerError):
    """A new generation did not form: its ranks' rendezvous timed out, a connection to a peer
    failed, or ranks did not answer. Still a ``worker_error``; nothing the training code
    did, so a job that meets one while it starts begins again (within ``elastic.max_failures``),
    on the same workers where they answered, instead of failing as a start-up error would."""

    starts_again = True


class NodeResourceError(WorkerError):
    """A rank's call failed because its node ran out of what Ray needs there (its disk: Ray's
    ``OutOfDiskError``). Still a ``worker_error`` (nobody is evicted for one), but the node's
    fault, not the training code's: it counts against the node (``elastic.lemon_failures``),
    so a full disk excludes its node after a few tries instead of spending the job's whole
    failure budget on re-formations in place that meet the same disk."""

    node_fault = True


class LoaderStalled(WorkerError):
    """Ranks' data loaders gave them no batch within the bound (``LoaderTimeout``). Still a
    ``worker_error``, but named: the failure event says how long they waited
    (``loader_wait_s``), and a job whose loader hangs again before it trains a step ends
    (``LOADER_RETRIES``) instead of spending its failure budget one timeout at a time."""

    def __init__(self, detail: str, waited_s: float, ranks: list[int] | None = None, nodes: list[str] | None = None):
        super().__init__(detail, ranks, nodes)
        self.waited_s = waited_s


LOADER_RETRIES = 1  # re-formations after a loader stall before the job ends, if no step trained between


def failure_fields(f: WorkerFailure) -> dict:
    """A ``failure`` event's fields; ``node_fault: true`` only where the node is to blame
    although the cause alone would not say so; ``loader_wait_s`` for a loader that hung;
    ``store_denied`` only where the rendezvous store refused outsiders meanwhile
    (``WorkerFailure.note_store_denials``)."""
    fields: dict[str, Any] = {"cause": f.cause, "ranks": f.ranks, "nodes": f.nodes, "detail": f.detail}
    if isinstance(f, LoaderStalled):
        fields["loader_wait_s"] = round(f.waited_s, 3)
    if f.store_denied:
        fields["store_denied"] = f.store_denied
    return {**fields, "node_fault": True} if f.node_fault else fields


class NotRetryable(WorkerError):
    """A rank's own error that a retry would repeat (a ``CorpusError``): the job fails at once,
    without spending its failure budget on retries."""

    retryable = False


class Straggler(WorkerFailure):
    """A straggler evicted by ``elastic.on_straggler: evict`` (docs/health.md)."""

    cause = "straggler"


class SilentCorruption(WorkerFailure):
    """The odd replica of an SDC check, evicted by ``elastic.on_sdc: evict`` (docs/health.md)."""

    cause = "sdc"


def cause_chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and the exceptions it wraps, outermost first: a ``RayTaskError`` carries the
    worker's own exception as its ``cause`` (and a task error can wrap another one)."""
    chain = [exc]
    for _ in range(5):
        inner = getattr(chain[-1], "cause", None)
        if not isinstance(inner, BaseException) or inner is chain[-1]:
            break
        chain.append(inner)
    return chain


def root_cause(exc: BaseException) -> str:
    """One line naming the exception a worker really raised (its own text, not Ray's
    header with colour codes)."""
    real = cause_chain(exc)[-1]
    text = " ".join(str(real).split())
    return f"{type(real).__name__}: {text[:300]}"
