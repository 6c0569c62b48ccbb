"""One strategy over one cluster history (docs/simulate.md), in the driver's process: the
discrete-event loop and its accounting of training, checkpoints and down time, kept together
(``_Run``), and the functions around it (the checkpoint interval, the closed form).
"""

from __future__ import annotations

import bisect
import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from elastic.simulator.cluster import DAY, Event, Job, Scenario, cluster_events
from elastic.simulator.costs import NODE_STAYS, Costs, cluster_costs
from elastic.simulator.reaction import Reaction


def strategy_costs(strategy: str, job: Job, step_s: float | None) -> Costs:
    """The costs of ``strategy`` on ``job``'s cluster (measured here or cited: costs.py)."""
    return cluster_costs(strategy, job.gpus, job.tp, job.pp, batch=job.batch, step_s=step_s)


@dataclass
class Result:
    strategy: str
    ettr: float
    goodput: float
    mean_dp_fraction: float
    failures: int  # failures that interrupted the job
    node_failures: int
    lost_work_s: float
    downtime_s: float
    blocking_s: float
    breakdown_s: dict[str, float]
    job_failed_at_s: float | None
    recoveries: list[dict[str, Any]] = field(default_factory=list)
    timeline: list[tuple[float, int]] = field(default_factory=list)
    failure_marks: list[tuple[float, str, bool]] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        return {
            "ettr": round(self.ettr, 5),
            "goodput": round(self.goodput, 5),
            "mean_dp_fraction": round(self.mean_dp_fraction, 5),
            "failures": self.failures,
            "node_failures": self.node_failures,
            "lost_work_s": round(self.lost_work_s, 1),
            "downtime_s": round(self.downtime_s, 1),
            "blocking_s": round(self.blocking_s, 1),
            "breakdown_s": {k: round(v, 1) for k, v in sorted(self.breakdown_s.items(), key=lambda kv: -kv[1])},
            "job_failed_at_s": self.job_failed_at_s,
        }


class _Run:
    """One strategy over one cluster history."""

    def __init__(self, job, sc, costs: Costs, strategy: str, interval_s: float, reaction: Reaction, start_key):
        self.job, self.costs, self.strategy, self.r = job, costs, strategy, reaction
        self.end = sc.days * DAY
        self.interval = interval_s
        self.key = start_key
        self.dp = reaction.dp(start_key) or 0
        self.max_dp = reaction.allowed[-1]
        self.acc: dict[str, float] = defaultdict(float)
        self.kept = self.work = self.train_wall = self.dp_wall = 0.0
        self.failures = self.node_failures = 0
        self.failed_at: float | None = None
        self.recoveries: list[dict] = []
        self.timeline: list[tuple[float, int]] = [(0.0, self.dp)]
        self.marks: list[tuple[float, str, bool]] = []
        self.seg_start: float | None = 0.0 if self.dp else None
        self.phases: list[tuple[str, float, float]] = []  # (cost, start, end) while down
        self.waiting_since: float | None = None if self.dp else 0.0
        self.pending: dict | None = None  # the recovery in progress
        self.next_dp = self.dp

    # ---------------------------------------------------------------- training segments
    def _segment(self, t: float) -> tuple[float, float, float, float, float]:
        """(elapsed wall, compute done, step s, cycle s, compute per cycle) of the open segment."""
        c = self.costs
        step = self.r.step_s(self.dp, c.step_s)
        f = c.snapshot_blocking_s / step
        cycle = self.interval * (1 + f) + c.ckpt_blocking_s
        if self.seg_start is None:
            raise RuntimeError("simulator: no training segment is open")
        e = t - self.seg_start
        n = math.floor(e / cycle)
        tau = n * self.interval + min((e - n * cycle) / (1 + f), self.interval)
        return e, tau, step, cycle, f

    def _close(self, t: float, how: str) -> tuple[float, float]:
        """End the training segment at ``t``: ``graceful`` keeps everything, ``memory`` loses
        the step in progress, ``storage`` everything since the last usable checkpoint.
        Returns (lost compute s, step s)."""
        e, tau, step, cycle, _ = self._segment(t)
        c = self.costs
        if how == "graceful":
            lost = 0.0
        elif how == "memory":
            lost = tau - step * math.floor(tau / step + 1e-9)
        else:
            lag = max(c.ckpt_blocking_s, c.ckpt_write_s)
            usable = max(0, math.floor((e + c.ckpt_blocking_s - lag) / cycle + 1e-9))
            lost = max(0.0, tau - min(usable * self.interval, tau))
        kept = tau - lost
        self.kept += kept
        self.work += kept * self.dp / self.max_dp
        self.acc["lost_work"] += lost
        self.acc["blocking"] += e - tau
        self.train_wall += e
        self.dp_wall += e * self.dp / self.max_dp
        self.seg_start = None
        return lost, step

    # ---------------------------------------------------------------- down phases
    def _spent(self, t: float) -> None:
        """Charge the phases of the recovery in progress up to ``t``."""
        for cost, a, b in self.phases:
            self.acc[cost] += max(0.0, min(t, b) - a)
        self.phases = []

    def _plan_recovery(self, t: float, cause: str, survivors: int) -> None:
        """Schedule the phases that bring the job back, from ``t`` (detection done)."""
        c, key = self.costs, self.key
        dp = self.r.dp(key)
        if dp is None:  # below min_dp: wait for capacity (a repair) and plan again then
            if self.pending is None:
                raise RuntimeError("simulator: a recovery is planned with none in progress")
            self.waiting_since, self.pending["survivors"] = t, survivors
            self.timeline.append((t, 0))
            return
        if self.strategy == "restart":
            steps = [("restart", c.restart_s)]
        else:
            restore = c.restore_storage_s if cause == "sdc" else c.restore_memory_s
            if dp > survivors:
                restore = max(restore, c.restore_peer_s)
            steps = [("reconfigure", c.reconfigure_s), ("restore", restore)]
        for cost, d in steps:
            self.phases.append((cost, t, t + d))
            t += d
        self.next_dp = dp

    def _fail(self, ev: Event) -> None:
        t, c = ev.t, self.costs
        self.node_failures += 1
        in_use_nodes = self.dp_nodes()
        before = ev.healthy
        hit = self.failed_at is None and before > 0 and ev.u < in_use_nodes / before
        self.marks.append((t, ev.cause, hit))
        if not hit:
            return
        self.failures += 1
        lost, steps_lost = 0.0, 0
        dp_before = self.dp if self.seg_start is not None else self.next_dp
        if self.seg_start is not None:
            how = "storage" if self.strategy == "restart" or ev.cause == "sdc" else "memory"
            lost, step = self._close(t, how)
            steps_lost = math.floor(lost / step + 1e-6)
        else:
            self._spent(t)
        if not self.r.budget_left(self.failures):
            self.failed_at = t
            self.timeline.append((t, 0))
            self.phases = []
            return
        if self.waiting_since is not None:  # it may still have been detecting the last failure
            self.acc["wait_capacity"] += max(0.0, t - self.waiting_since)
            self.waiting_since = None
        detect = c.detect_s[ev.cause]
        late = 0.0
        if ev.cause == "sdc" and dp_before:  # found at the next check; the work since the corruption is lost
            late = c.sdc_check_every_steps * self.r.step_s(dp_before, c.step_s) / 2
        self.phases = [("lost_work", t, t + late), ("detect", t + late, t + late + detect)]
        detect += late
        self.timeline.append((t, 0))
        node_stays = ev.cause in NODE_STAYS
        survivors = dp_before if node_stays else self.r.survivors(self.key, dp_before)
        self.key = ev.key
        self.pending = {"t": t, "cause": ev.cause, "detect_s": detect, "lost_work_s": lost}
        self.pending.update(lost_steps=steps_lost, dp_before=dp_before)
        self._plan_recovery(t + detect, ev.cause, survivors)

    def dp_nodes(self) -> int:
        dp = self.dp if self.seg_start is not None else self.next_dp
        return dp * self.job.replica_gpus // self.job.gpus_per_node

    def _repair(self, ev: Event) -> None:
        self.key = ev.key
        if self.failed_at is not None:
            return
        if self.waiting_since is not None:
            if self.r.dp(self.key) is None:
                return
            # Capacity back before the failure was even detected: the recovery starts after
            # the detection, never before it (nor is the wait negative).
            start = max(ev.t, self.waiting_since)
            self.acc["wait_capacity"] += start - self.waiting_since
            self.waiting_since = None
            if self.pending is None:  # the job never started
                self.pending = {"t": ev.t, "cause": "start", "detect_s": 0.0, "lost_work_s": 0.0, "dp_before": 0}
            self._plan_recovery(start, self.pending["cause"], self.pending.get("survivors", 0))
            return
        if self.seg_start is not None:
            self._grow(ev.t)

    def _grow(self, t: float) -> None:
        new = self.r.grow(self.dp, self.key)
        if new is None:
            return
        self._close(t, "graceful")
        c = self.costs
        if self.strategy == "restart":  # checkpoint on demand, then restart at the larger size
            w = c.ckpt_blocking_s
            self.phases = [("blocking", t, t + w), ("restart", t + w, t + w + c.restart_s)]
        else:
            self.phases = [("grow", t, t + c.grow_s)]
        self.pending = None
        self.next_dp = new
        self.timeline.append((t, 0))

    def _resume(self, t: float) -> None:
        self._spent(t)
        if self.strategy == "restart" and self.pending is not None:
            # A restarted job rendezvouses at the end of its restart: the size it finds then.
            self.next_dp = self.r.dp(self.key) or self.next_dp
        if self.pending is not None:
            p = self.pending
            self.recoveries.append(
                {
                    "t": p["t"],
                    "cause": p["cause"],
                    "detect_s": p["detect_s"],
                    "downtime_s": t - p["t"],
                    "lost_work_s": p["lost_work_s"],
                    "lost_steps": p.get("lost_steps", 0),
                    "dp_before": p["dp_before"],
                    "dp_after": self.next_dp,
                }
            )
        self.pending = None
        self.dp = self.next_dp
        self.seg_start = t
        self.timeline.append((t, self.dp))
        self._grow(t)  # capacity may have returned while the job was down

    def _check_accounts(self) -> None:
        """Every second of the wall clock is kept work or one cost, none negative: a result
        that breaks this is the simulator's error, never printed as a figure."""
        negative = {k: v for k, v in self.acc.items() if v < -1e-6}
        total = self.kept + sum(self.acc.values())
        if negative or abs(total - self.end) > 1e-6 * self.end:
            raise RuntimeError(f"simulator: the accounts do not add up ({total:.1f} s of {self.end:.1f}; {negative})")

    def run(self, events: list[Event]) -> Result:
        i = 0
        while True:
            t_up = self.phases[-1][2] if self.phases and self.waiting_since is None else math.inf
            t_ev = events[i].t if i < len(events) else math.inf
            if min(t_up, t_ev) > self.end:
                break
            if t_up <= t_ev:
                self._resume(t_up)
                continue
            ev = events[i]
            i += 1
            (self._fail if ev.kind == "fail" else self._repair)(ev)
        if self.seg_start is not None:
            self._close(self.end, "graceful")
        self._spent(self.end)
        if self.waiting_since is not None:
            self.acc["wait_capacity"] += max(0.0, self.end - self.waiting_since)
        if self.failed_at is not None:
            self.acc["job_failed"] += self.end - self.failed_at
        self._check_accounts()
        downtime = sum(v for k, v in self.acc.items() if k not in ("lost_work", "blocking", "job_failed"))
        if self.max_dp:
            self.acc["reduced_dp"] = max(0.0, self.kept - self.work)
        return Result(
            strategy=self.strategy,
            ettr=self.kept / self.end,
            goodput=self.work / self.end,
            mean_dp_fraction=self.dp_wall / self.train_wall if self.train_wall else 0.0,
            failures=self.failures,
            node_failures=self.node_failures,
            lost_work_s=self.acc["lost_work"],
            downtime_s=downtime,
            blocking_s=self.acc["blocking"],
            breakdown_s=dict(self.acc),
            job_failed_at_s=self.failed_at,
            recoveries=self.recoveries,
            timeline=self.timeline,
            failure_marks=self.marks,
        )


def effective_interval(costs: Costs, interval_s: float) -> float:
    """A checkpoint cannot start before the previous one is usable (one upload at a time)."""
    return max(interval_s, costs.ckpt_write_s, costs.step_s)


def simulate(
    job: Job,
    sc: Scenario,
    costs: Costs,
    strategy: str,
    interval_s: float,
    events: tuple[tuple, list[Event]] | None = None,
    reaction: Reaction | None = None,
) -> Result:
    """Simulate one strategy; pass ``events`` and ``reaction`` to share them between runs."""
    if strategy not in ("inplace", "restart"):
        raise ValueError(f"strategy must be inplace or restart, got {strategy!r}")
    start, evs = events if events is not None else cluster_events(job, sc)
    reaction = reaction or Reaction(job)
    return _Run(job, sc, costs, strategy, effective_interval(costs, interval_s), reaction, start).run(evs)


def interval_grid(costs: Costs, hi_s: float = 6 * 3600.0, points: int = 40) -> list[float]:
    lo = effective_interval(costs, 0.0)
    if hi_s <= lo:
        return [lo]
    ratio = (hi_s / lo) ** (1 / (points - 1))
    return [lo * ratio**i for i in range(points)]


def best_interval(job, sc, costs, strategy, events=None, reaction=None) -> tuple[float, list[tuple[float, float]]]:
    """The grid interval with the highest ETTR on this cluster history, and the whole curve."""
    events = events if events is not None else cluster_events(job, sc)
    reaction = reaction or Reaction(job)
    curve = [(s, simulate(job, sc, costs, strategy, s, events, reaction).ettr) for s in interval_grid(costs)]
    best = max(curve, key=lambda p: p[1])[0]
    return best, curve


def closed_form_ettr(nodes: int, rate_per_node_s: float, u0: float, interval_s: float, w: float) -> float:
    """Meta's approximation (arXiv 2410.21680): (1 - N r (u0 + dt/2)) / (1 + w/dt)."""
    return (1 - nodes * rate_per_node_s * (u0 + interval_s / 2)) / (1 + w / interval_s)


def dp_at(timeline: list[tuple[float, int]], t: float) -> int:
    times = [p[0] for p in timeline]
    i = bisect.bisect_right(times, t) - 1
    return timeline[max(i, 0)][1]
