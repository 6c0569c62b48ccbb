"""Faults that raise no error: stragglers, lemon nodes, silent data corruption (docs/health.md).

The pure parts (``StragglerDetector``, ``vote``, ``LemonTracker``) take plain inputs and are
unit-tested without Ray. ``HealthMonitor`` is the controller's side: it is fed every
committed step and every ``SdcReport``, writes the ``straggler``, ``sdc`` and
``node_excluded`` events, and hands the controller a ``WorkerFailure`` to recover from when
a policy says evict. The workers' side of the SDC check is ``elastic/worker/sdc.py``.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from elastic.errors import SilentCorruption, Straggler, WorkerFailure
from elastic.events import Recovery
from elastic.messages import SdcReport, StepReport
from elastic.worker.sdc_vote import sdc_due

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------- stragglers


@dataclass(frozen=True)
class StragglerEpisode:
    ranks: list[int]
    slowdown: float  # the slowest rank's own compute over the median of its peers, last step


class StragglerDetector:
    """A rank whose own compute exceeds ``factor`` x the median of its peers' for ``steps``
    committed steps in a row is a straggler. One episode is reported once, when it starts;
    a rank that falls back under the factor for a step ends its episode.

    The median of the *peers* (the rank itself left out) is robust: one slow rank cannot
    lift the reference it is compared with, and a single noisy peer cannot either once
    there are three or more. With two ranks the peer median is the other rank.
    """

    def __init__(self, factor: float, steps: int):
        self.factor, self.steps = factor, steps
        self._run: dict[int, int] = {}  # rank -> consecutive slow steps
        self._reported: set[int] = set()  # ranks whose current episode was reported

    def reset(self) -> None:
        """A new layout: ranks are renumbered, counts start over."""
        self._run.clear()
        self._reported.clear()

    def feed(self, compute_s: dict[int, float]) -> StragglerEpisode | None:
        """One committed step's own compute per rank; returns a new episode or None."""
        if len(compute_s) < 2:
            return None
        ratios: dict[int, float] = {}
        for rank, own in compute_s.items():
            peers = [v for r, v in compute_s.items() if r != rank]
            ref = statistics.median(peers)
            ratios[rank] = own / ref if ref > 0 else 1.0
        new = []
        for rank, ratio in ratios.items():
            if ratio > self.factor:
                self._run[rank] = self._run.get(rank, 0) + 1
                if self._run[rank] >= self.steps and rank not in self._reported:
                    self._reported.add(rank)
                    new.append(rank)
            else:
                self._run.pop(rank, None)
                self._reported.discard(rank)
        if not new:
            return None
        return StragglerEpisode(sorted(new), round(max(ratios[r] for r in new), 3))


# --------------------------------------------------------------------------- commits behind SDC checks


class CommitGate:
    """The storage committer behind a gate: a step's checkpoint is committed only once an
    SDC check at that step or later passed, and dropped when a check finds corruption
    first. Corrupted state is never made durable."""

    def __init__(self, committer: Any):
        self.inner = committer
        self.verified = -1
        self._held: dict[int, list[tuple[int, Any]]] = {}  # step -> (rank, UploadReport)

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
        for held in [s for s in self._held if s > step]:
            logger.warning("checkpoint of step %d dropped: written after the last verified step %d", held, step)
            del self._held[held]

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
    and are not counted. ``limit == 0`` never excludes.
    """

    NOT_THE_NODE = ("worker_error", "nan_loss", "loss_spike")

    def __init__(self, limit: int):
        self.limit = limit
        self.counts: dict[str, int] = {}
        self.excluded: dict[str, str] = {}  # node id -> reason

    def blame(self, nodes: Sequence[str], all_nodes: Sequence[str], cause: str) -> list[str]:
        """Count one failure against ``nodes``; returns the nodes newly excluded."""
        nodes = sorted(set(nodes))
        if not self.limit or not nodes or set(nodes) >= set(all_nodes) or cause in self.NOT_THE_NODE:
            return []
        new = []
        for node in nodes:
            self.counts[node] = self.counts.get(node, 0) + 1
            if self.counts[node] >= self.limit and node not in self.excluded:
                self.excluded[node] = f"{self.counts[node]} failures or evictions (last: {cause})"
                new.append(node)
        return new


# --------------------------------------------------------------------------- the controller's side


class HealthMonitor:
    """Glue between the controller and the detectors above (all effects go through ``ctl``)."""

    def __init__(self, ctl: Any):
        e = ctl.spec.elastic
        self.ctl, self.e = ctl, e
        self.stragglers = StragglerDetector(e.straggler_factor, e.straggler_steps)
        self.lemons = LemonTracker(e.lemon_failures)
        self.failure: WorkerFailure | None = None  # an eviction for the controller to carry out
        self._world = 0
        self._incident: tuple[int, int] | None = None  # (step, restored step) of the last SDC rollback
        self._stale: set[int] = set()  # ranks whose pre-rollback reports may still arrive
        self._last_step = ctl.spec.train.steps
        ctl.events.subscribe(self._on_event)

    # ----- stragglers
    def on_step(self, step: int, results: dict[int, StepReport]) -> None:
        if isinstance(self.ctl.committer, CommitGate) and sdc_due(step, self.e.sdc_check_every, self._last_step):
            self.ctl.committer.verify(step)  # every rank passed this step's check
        if len(results) != self._world:  # a new layout
            self._world = len(results)
            self.stragglers.reset()
        episode = self.stragglers.feed({r: rep.compute_s for r, rep in results.items()})
        if episode is None:
            return
        members = {m.rank: m for m in self.ctl.group.members}
        nodes = sorted({members[r].node_id for r in episode.ranks if r in members})
        self.ctl.events.emit("straggler", ranks=episode.ranks, nodes=nodes, slowdown=episode.slowdown)
        logger.warning(
            "straggler: ranks %s on %s, %.2fx the median of their peers", episode.ranks, nodes, episode.slowdown
        )
        if self.e.on_straggler == "evict" and self.failure is None:
            on_nodes = sorted(m.rank for m in members.values() if m.node_id in nodes)
            self.failure = Straggler(
                f"ranks {episode.ranks} {episode.slowdown:.2f}x slower than their peers' median "
                f"for {self.e.straggler_steps} steps: node evicted",
                ranks=on_nodes,
                nodes=nodes,
            )

    def take_failure(self) -> WorkerFailure | None:
        failure, self.failure = self.failure, None
        return failure

    # ----- silent data corruption
    def stale(self, rank: int) -> bool:
        """Reports of ``rank`` from before an SDC rollback it has not announced yet are stale."""
        return rank in self._stale

    def on_sdc(self, rank: int, report: SdcReport) -> None:
        ctl = self.ctl
        key = (report.step, report.restored_step)
        self._stale.discard(rank)
        if key == self._incident:
            return
        self._incident = key
        self._stale = {m.rank for m in ctl.group.members} - {rank}
        evict = self.e.on_sdc == "evict" and report.decided
        ctl.events.emit(
            "sdc",
            step=report.step,
            ranks=list(report.ranks),
            replica=report.replica,
            action="evict" if evict else "repair",
            restored_step=report.restored_step,
        )
        ctl.events.emit("restore", step=report.restored_step, source="memory", duration_s=report.restore_s)
        logger.warning(
            "silent data corruption at step %d on ranks %s: rolled back to step %d",
            report.step,
            list(report.ranks),
            report.restored_step,
        )
        self._rolled_back(report, evict)
        if isinstance(ctl.committer, CommitGate):
            ctl.committer.drop_after(report.restored_step)
        if evict and self.failure is None:
            members = {m.rank: m for m in ctl.group.members}
            nodes = sorted({members[r].node_id for r in report.ranks if r in members})
            self.failure = SilentCorruption(
                f"step {report.step}: parameters of replica {report.replica} differ from their twins'; "
                f"rolled back to step {report.restored_step}, node evicted",
                ranks=sorted(m.rank for m in members.values() if m.node_id in nodes),
                nodes=nodes,
            )

    def _rolled_back(self, report: SdcReport, evict: bool) -> None:
        """Like an anomaly's rollback: the steps after ``restored_step`` are redone."""
        ctl = self.ctl
        ctl.step = min(ctl.step, report.restored_step)
        for step in [s for s in ctl._pending if s > report.restored_step]:
            del ctl._pending[step]
        lost = max(0, report.step - report.restored_step)
        ctl.recoveries.append(Recovery(cause="sdc", detect_s=0.0, recover_s=0.0, downtime_s=0.0, lost_steps=lost))
        if evict:  # the eviction's recovery records the failure
            return
        ctl.failures += 1
        members = {m.rank: m for m in ctl.group.members}
        ctl.events.emit(
            "failure",
            cause="sdc",
            ranks=list(report.ranks),
            nodes=sorted({members[r].node_id for r in report.ranks if r in members}) if report.decided else [],
            detail=f"step {report.step}: parameter fingerprints of replicas differ; "
            f"rolled back to verified step {report.restored_step}",
        )

    # ----- lemon nodes
    def _on_event(self, event: dict[str, Any]) -> None:
        if event["kind"] != "failure" or not event.get("nodes"):
            return
        all_nodes = [m.node_id for m in self.ctl.group.members]
        for node in self.lemons.blame(event["nodes"], all_nodes, event.get("cause", "")):
            reason = self.lemons.excluded[node]
            self.ctl.events.emit("node_excluded", node_id=node, reason=reason)
            logger.warning("node %s excluded from this job: %s", node, reason)
            exclude = getattr(self.ctl.group, "exclude_nodes", None)
            if exclude is not None:
                exclude([node])

    def excluded_nodes(self) -> list[dict[str, str]]:
        return [{"node_id": n, "reason": r} for n, r in self.lemons.excluded.items()]
