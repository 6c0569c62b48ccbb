"""Faults that raise no error: stragglers, lemon nodes, silent data corruption (docs/health.md).

The pure parts (``StragglerDetector``, ``LemonTracker``; the SDC vote is on the workers'
side, ``elastic/worker/sdc_vote.py``) take plain inputs and are unit-tested without Ray.
``HealthMonitor`` is the controller's side: it is fed every committed step and every
``SdcReport``, writes the ``straggler``, ``sdc`` and ``node_excluded`` events, and returns
what the controller must do: a ``WorkerFailure`` to recover from when a policy says evict,
a ``Rollback`` to apply. The workers' side of the SDC check is ``elastic/worker/sdc.py``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from elastic.errors import SilentCorruption, Straggler, WorkerFailure
from elastic.events import EventLog, Recovery
from elastic.messages import SdcReport, StepRows
from elastic.worker.sdc_vote import sdc_due

if TYPE_CHECKING:
    from elastic.control.worker_group.api import Member
    from elastic.spec import JobSpec

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------- stragglers


@dataclass(frozen=True)
class StragglerEpisode:
    ranks: list[int]
    slowdown: float  # the slowest rank's own compute over the median of its peers, last step


MIN_EXCESS_S = 0.005  # a straggler is also this much over its peers' median (see StragglerDetector)
# The first steps of each layout (a job's start, every re-formation) are not judged: a rank
# just started or just re-formed warms its caches, allocator and (compiled) kernels, and on
# a shared host the ranks do not warm equally. A CI run saw rank 2 of 4 reported at 1.84x
# its peers in its first six steps and evicted.
STRAGGLER_WARMUP_STEPS = 5


class StragglerDetector:
    """A rank whose own compute exceeds ``factor`` x the median of its peers' for ``steps``
    committed steps in a row, and by at least ``MIN_EXCESS_S``, is a straggler. (The floor:
    on a step of a few milliseconds, a tiny model's, the caches' and the scheduler's noise
    alone passes 30% now and then; a rank that costs its peers 5 ms a step or more is what
    is worth a report.) One episode is reported once, when it starts;
    a rank that falls back under the factor for a step ends its episode. The first
    ``warmup`` steps after the detector starts or is ``reset`` are not judged.

    The median of the *peers* (the rank itself left out) is robust: one slow rank cannot
    lift the reference it is compared with, and a single noisy peer cannot either once
    there are three or more. With two ranks the peer median is the other rank.
    """

    def __init__(self, factor: float, steps: int, warmup: int = 0):
        self.factor, self.steps, self.warmup = factor, steps, warmup
        self._run: dict[int, int] = {}  # rank -> consecutive slow steps
        self._reported: set[int] = set()  # ranks whose current episode was reported
        self._skipped = 0  # steps of this layout's warm-up seen so far

    def reset(self) -> None:
        """A new layout: ranks are renumbered, counts start over after a new warm-up."""
        self._run.clear()
        self._reported.clear()
        self._skipped = 0

    def feed(self, compute_s: Mapping[int, float]) -> StragglerEpisode | None:
        """One committed step's own compute per rank; returns a new episode or None.

        One sort per step (O(N log N)): each rank's peer median is read from the sorted
        values with the rank's own value left out.
        """
        ranks = np.fromiter(compute_s.keys(), dtype=np.int64, count=len(compute_s))
        own = np.fromiter(compute_s.values(), dtype=np.float64, count=len(compute_s))
        return self.feed_columns(ranks, own)

    def feed_columns(self, ranks: np.ndarray, own: np.ndarray) -> StragglerEpisode | None:
        """``feed`` for a step given as columns: the ranks and their own compute."""
        if self._skipped < self.warmup:
            self._skipped += 1
            return None
        if len(ranks) < 2:
            return None
        ref = peer_medians(own)
        safe = np.where(ref > 0, ref, 1.0)
        ratios = np.where(ref > 0, own / safe, 1.0)
        slow = (ratios > self.factor) & (own - ref >= MIN_EXCESS_S)
        slow_ranks = set(ranks[slow].tolist())
        present = set(ranks.tolist()) if self._run else set()
        for rank in [r for r in self._run if r not in slow_ranks and r in present]:  # the episode ends
            del self._run[rank]
            self._reported.discard(rank)
        new = []
        for rank in slow_ranks:
            self._run[rank] = self._run.get(rank, 0) + 1
            if self._run[rank] >= self.steps and rank not in self._reported:
                self._reported.add(rank)
                new.append(rank)
        if not new:
            return None
        ratio_of = dict(zip(ranks[slow].tolist(), ratios[slow].tolist()))
        return StragglerEpisode(sorted(new), round(max(ratio_of[r] for r in new), 3))


def peer_medians(values: np.ndarray) -> np.ndarray:
    """For each value, the median of all the others (``statistics.median``'s convention: the
    mean of the two middle ones for an even count), from one sort."""
    n = len(values)
    order = np.argsort(values, kind="stable")
    s = values[order]
    pos = np.empty(n, dtype=np.int64)
    pos[order] = np.arange(n)

    def without_self(j: int) -> np.ndarray:  # element j of the sorted values once one's own is left out
        return np.where(j < pos, s[j], s[min(j + 1, n - 1)])

    if (n - 1) % 2:  # an odd count of peers: the middle one
        return without_self((n - 2) // 2)
    mid = (n - 1) // 2
    return (without_self(mid - 1) + without_self(mid)) / 2


# --------------------------------------------------------------------------- commits behind SDC checks


class CommitGate:
    """The storage committer behind a gate: a step's checkpoint is committed only once an
    SDC check at that step or later passed, and dropped when a check finds corruption
    first. Corrupted state is never made durable."""

    def __init__(self, committer: Any):
        self.inner = committer
        self.verified = -1
        self._held: dict[int, list[tuple[int, Any]]] = {}  # step -> (rank, UploadReport)

    def close(self) -> None:
        for held in sorted(self._held):  # complete or not, never verified: never committed
            self.inner.dropped(held, "no SDC check verified it before the job ended")
        self._held.clear()
        self.inner.close()

    def add(self, rank: int, report: Any) -> None:
        if report.step <= self.verified:
            self.inner.add(rank, report)
        else:
            self._held.setdefault(report.step, []).append((rank, report))

    def verify(self, step: int) -> None:
        self.verified = max(self.verified, step)
        for held in sorted(s for s in self._held if s <= step):
            for rank, report in self._held.pop(held):
                self.inner.add(rank, report)

    def drop_after(self, step: int) -> None:
        for held in sorted(s for s in self._held if s > step):
            del self._held[held]
            self.inner.dropped(held, f"dropped: written after the last verified step {step} (an SDC check failed)")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def gate_commits(committer: Any, spec: Any) -> Any:
    """``committer`` itself with SDC checks off (or no storage tier), else behind a ``CommitGate``."""
    if committer is None or not spec.elastic.sdc_check_every:
        return committer
    return CommitGate(committer)


# --------------------------------------------------------------------------- lemon nodes


class LemonTracker:
    """Counts the failures and evictions each node caused; ``limit`` of them exclude it.

    A failure that blames every node of the job blames none (a job-wide timeout says
    nothing about any one node, and a one-node job must not exclude its only node). A
    rank's own exception (``worker_error``) and a bad loss say nothing about the hardware
    and are not counted, unless the failure says the node is to blame (``node_fault``: its
    disk is full). ``limit == 0`` never excludes.
    """

    NOT_THE_NODE = ("worker_error", "nan_loss", "loss_spike")

    def __init__(self, limit: int):
        self.limit = limit
        self.counts: dict[str, int] = {}
        self.excluded: dict[str, str] = {}  # node id -> reason

    def blame(self, nodes: Sequence[str], all_nodes: Sequence[str], cause: str, node_fault: bool = False) -> list[str]:
        """Count one failure against ``nodes``; returns the nodes newly excluded."""
        nodes = sorted(set(nodes))
        if not self.limit or not nodes or set(nodes) >= set(all_nodes):
            return []
        if cause in self.NOT_THE_NODE and not node_fault:
            return []
        new = []
        for node in nodes:
            self.counts[node] = self.counts.get(node, 0) + 1
            if self.counts[node] >= self.limit and node not in self.excluded:
                self.excluded[node] = f"{self.counts[node]} failures or evictions (last: {cause})"
                new.append(node)
        return new


# --------------------------------------------------------------------------- the controller's side


@dataclass(frozen=True)
class Rollback:
    """Every rank rolled back in place to ``to_step`` (an SDC repair): the controller forgets
    the steps after it and records ``recovery``; ``counts`` says whether it is a failure."""

    to_step: int
    recovery: Recovery
    counts: bool


class HealthMonitor:
    """The controller's health detectors: fed every committed step and every ``SdcReport``,
    it writes the ``straggler``, ``sdc`` and ``node_excluded`` events and returns what the
    controller must do (an eviction to recover from, a rollback to apply). It changes no
    state of the controller's."""

    def __init__(
        self,
        spec: JobSpec,
        events: EventLog,
        members: Callable[[], Sequence[Member]],
        exclude: Callable[[list[str]], None],
        gate: CommitGate | None,
    ):
        e = spec.elastic
        self.e, self.events, self._members, self._exclude, self._gate = e, events, members, exclude, gate
        self.stragglers = StragglerDetector(e.straggler_factor, e.straggler_steps, STRAGGLER_WARMUP_STEPS)
        self.lemons = LemonTracker(e.lemon_failures)
        self._world = 0
        self._incident: tuple[int, int] | None = None  # (step, restored step) of the last SDC rollback
        self._stale: set[int] = set()  # ranks whose pre-rollback reports may still arrive
        self._last_step = spec.train.steps
        events.subscribe(self._on_event)

    def _nodes_of(self, ranks: Iterable[int]) -> list[str]:
        wanted = set(ranks)
        return sorted({m.node_id for m in self._members() if m.rank in wanted})

    # ----- stragglers
    def new_layout(self) -> None:
        """The group re-formed: its next step starts a new straggler warm-up and count, even
        at the same size (a lost node replaced: the newcomer starts cold)."""
        self._world = 0

    def on_step(self, step: int, rows: StepRows) -> WorkerFailure | None:
        """A committed step (every rank's report, as columns); returns a straggler eviction
        when ``on_straggler`` is evict."""
        if self._gate is not None and sdc_due(step, self.e.sdc_check_every, self._last_step):
            self._gate.verify(step)  # every rank passed this step's check
        if len(rows.ranks) != self._world:  # a new layout: the job's first, or a re-formation's
            self._world = len(rows.ranks)
            self.stragglers.reset()
        episode = self.stragglers.feed_columns(rows.ranks, rows.compute_s)
        if episode is None:
            return None
        nodes = self._nodes_of(episode.ranks)
        self.events.emit("straggler", ranks=episode.ranks, nodes=nodes, slowdown=episode.slowdown)
        logger.warning(
            "straggler: ranks %s on %s, %.2fx the median of their peers", episode.ranks, nodes, episode.slowdown
        )
        if self.e.on_straggler != "evict":
            return None
        return Straggler(
            f"ranks {episode.ranks} {episode.slowdown:.2f}x slower than their peers' median "
            f"for {self.e.straggler_steps} steps: node evicted",
            ranks=sorted(m.rank for m in self._members() if m.node_id in nodes),
            nodes=nodes,
        )

    # ----- silent data corruption
    def stale(self, rank: int) -> bool:
        """Reports of ``rank`` from before an SDC rollback it has not announced yet are stale."""
        return rank in self._stale

    def stale_ranks(self) -> set[int]:
        return self._stale

    def on_sdc(self, rank: int, report: SdcReport) -> tuple[Rollback | None, WorkerFailure | None]:
        """One rank's ``SdcReport``; the first of an incident returns its rollback (and an
        eviction with ``on_sdc: evict`` when a majority named the odd replica)."""
        key = (report.step, report.restored_step)
        self._stale.discard(rank)
        if key == self._incident:
            return None, None
        self._incident = key
        self._stale = {m.rank for m in self._members()} - {rank}
        evict = self.e.on_sdc == "evict" and report.decided
        self.events.emit(
            "sdc",
            step=report.step,
            ranks=list(report.ranks),
            replica=report.replica,
            action="evict" if evict else "repair",
            restored_step=report.restored_step,
        )
        self.events.emit("restore", step=report.restored_step, source="memory", duration_s=report.restore_s)
        logger.warning(
            "silent data corruption at step %d on ranks %s: rolled back to step %d",
            report.step,
            list(report.ranks),
            report.restored_step,
        )
        if self._gate is not None:
            self._gate.drop_after(report.restored_step)
        lost = max(0, report.step - report.restored_step)
        recovery = Recovery(cause="sdc", detect_s=0.0, recover_s=0.0, downtime_s=0.0, lost_steps=lost)
        rollback = Rollback(report.restored_step, recovery, counts=not evict)  # an eviction counts itself
        if not evict:
            self.events.emit(
                "failure",
                cause="sdc",
                ranks=list(report.ranks),
                nodes=self._nodes_of(report.ranks) if report.decided else [],
                detail=f"step {report.step}: parameter fingerprints of replicas differ; "
                f"rolled back to verified step {report.restored_step}",
            )
            return rollback, None
        nodes = self._nodes_of(report.ranks)
        return rollback, SilentCorruption(
            f"step {report.step}: parameters of replica {report.replica} differ from their twins'; "
            f"rolled back to step {report.restored_step}, node evicted",
            ranks=sorted(m.rank for m in self._members() if m.node_id in nodes),
            nodes=nodes,
        )

    # ----- lemon nodes
    def _on_event(self, event: dict[str, Any]) -> None:
        if event["kind"] != "failure" or not event.get("nodes"):
            return
        all_nodes = [m.node_id for m in self._members()]
        blamed = self.lemons.blame(event["nodes"], all_nodes, event.get("cause", ""), event.get("node_fault", False))
        for node in blamed:
            reason = self.lemons.excluded[node]
            self.events.emit("node_excluded", node_id=node, reason=reason)
            logger.warning("node %s excluded from this job: %s", node, reason)
            self._exclude([node])

    def excluded_nodes(self) -> list[dict[str, str]]:
        return [{"node_id": n, "reason": r} for n, r in self.lemons.excluded.items()]
