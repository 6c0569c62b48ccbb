"""Discrete-event failure simulator (docs/simulate.md); ~550 lines: one event loop and its accounting, kept together.

Two layers:

* **The cluster** (exogenous, the same for every strategy, so strategies and checkpoint
  intervals are compared on the same failures): nodes in racks fail as one Poisson process
  per node at ``failure_rate`` per 1,000 node-days, with a cause drawn from Llama 3's
  breakdown; a failed node comes back ``repair_hours`` later (software failures leave the
  node usable).
* **The job's reaction**, from the project's own code: the batch policy
  (``batch.allowed_dps``, ``batch.grad_accum``), the placement planner
  (``planner.plan_layout``: how many whole replicas the healthy nodes hold, rack-aware;
  ``planner.drop_nodes``: which replicas survive a loss), the scaling policy
  (``policies.target_dp``, ``policies.scaling_decision``: the largest allowed DP in whole
  replicas, growing back when capacity returns) and the failure policy
  (``policies.failure_decision``: the failure budget).

The planner is called once per distinct rack histogram (how many racks have how many
healthy nodes: the replica count depends on nothing else) and cached; when a TP group is
exactly one node it is called at node granularity (one slot per node, ``tp=1``), which
gives the same replicas eight times faster.
"""

from __future__ import annotations

import bisect
import heapq
import math
import random
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

from elastic.control import policies
from elastic.errors import InfeasibleError
from elastic.parallel import batch
from elastic.placement.planner import LayoutPlan, drop_nodes, plan_layout
from elastic.placement.topology import ClusterTopology, NodeInfo
from elastic.simulator.costs import CAUSES, LLAMA3_CAUSES, NODE_STAYS, Costs

DAY = 86400.0


@dataclass(frozen=True)
class Job:
    """The job and the cluster it runs on."""

    gpus: int = 16384
    gpus_per_node: int = 8
    nodes_per_rack: int = 2
    tp: int = 8
    pp: int = 16
    spares: int | None = None  # idle nodes beside the job's; None: 2% of the job's nodes
    global_batch: int | None = None  # sequences; None: 16 per replica at full DP (Llama 3)
    micro_batch: int = 1
    min_dp: int = 1
    max_failures: int | None = None  # the failure budget; None: unlimited

    @property
    def replica_gpus(self) -> int:
        return self.tp * self.pp

    @property
    def max_dp(self) -> int:
        return self.gpus // self.replica_gpus

    @property
    def job_nodes(self) -> int:
        return math.ceil(self.gpus / self.gpus_per_node)

    @property
    def spare_nodes(self) -> int:
        return math.ceil(0.02 * self.job_nodes) if self.spares is None else self.spares

    @property
    def total_nodes(self) -> int:
        return self.job_nodes + self.spare_nodes

    @property
    def batch(self) -> int:
        return 16 * self.micro_batch * self.max_dp if self.global_batch is None else self.global_batch


@dataclass(frozen=True)
class Scenario:
    failure_rate: float = 6.5  # node failures per 1,000 node-days
    days: float = 30.0
    repair_hours: float = 24.0
    seed: int = 0

    @property
    def rate_per_node_s(self) -> float:
        return self.failure_rate / 1000.0 / DAY


@dataclass(frozen=True)
class Event:
    t: float
    kind: str  # "fail" or "repair"
    cause: str = ""
    u: float = 0.0  # uniform draw: the failed node is one of the job's if u < in_use / healthy
    key: tuple = ()  # rack histogram after the event
    healthy: int = 0  # healthy nodes after the event


def _key(hist: Counter) -> tuple:
    return tuple(sorted((c, n) for c, n in hist.items() if n))


def _move(hist: Counter, old: int, new: int) -> None:
    hist[old] -= 1
    hist[new] += 1


def cluster_events(job: Job, sc: Scenario) -> tuple[tuple, list[Event]]:
    """The cluster's failures and repairs over ``sc.days``: (initial histogram, events)."""
    rng = random.Random(sc.seed)
    racks = math.ceil(job.total_nodes / job.nodes_per_rack)
    healthy = [job.nodes_per_rack] * racks
    healthy[-1] = job.total_nodes - job.nodes_per_rack * (racks - 1)
    total = sum(healthy)
    causes = list(CAUSES)
    weights = [LLAMA3_CAUSES[c][0] for c in causes]
    end, t, repairs, out = sc.days * DAY, 0.0, [], []
    rate = sc.rate_per_node_s
    hist = Counter(healthy)
    start = _key(hist)
    while True:
        t_fail = t + rng.expovariate(total * rate) if total and rate > 0 else math.inf
        if repairs and repairs[0][0] <= t_fail:
            t, rack = heapq.heappop(repairs)
            if t > end:
                break
            _move(hist, healthy[rack], healthy[rack] + 1)
            healthy[rack] += 1
            total += 1
            out.append(Event(t, "repair", key=_key(hist), healthy=total))
            continue
        t = t_fail
        if t > end:
            break
        cause = rng.choices(causes, weights)[0]
        u = rng.random()
        while True:  # a uniformly drawn healthy node: a rack, kept with probability healthy/size
            rack = rng.randrange(racks)
            if rng.random() * job.nodes_per_rack < healthy[rack]:
                break
        if cause not in NODE_STAYS:
            _move(hist, healthy[rack], healthy[rack] - 1)
            healthy[rack] -= 1
            total -= 1
            back = t + sc.repair_hours * 3600.0
            heapq.heappush(repairs, (back, rack))
        out.append(Event(t, "fail", cause, u, _key(hist), total + (cause not in NODE_STAYS)))
    return start, out


class Reaction:
    """The project's policies and planner, cached per rack histogram."""

    def __init__(self, job: Job):
        self.job = job
        self.allowed = batch.allowed_dps(job.batch, job.micro_batch, job.min_dp, job.max_dp)
        if not self.allowed:
            raise InfeasibleError("--global-batch", f"no DP degree in [{job.min_dp}, {job.max_dp}] divides it")
        self.node_level = job.tp == job.gpus_per_node
        self._plans: dict[tuple, LayoutPlan | None] = {}
        self._drops: dict[tuple, int] = {}
        self._replicas: dict[tuple, int] = {}
        self.exact = False  # True: plan the whole histogram, no reduction (for checking it)
        self.planner_calls = 0

    def reduce(self, key: tuple) -> tuple[tuple, int]:
        """A smaller histogram with the same replica count modulo whole groups of full racks,
        and the replicas those racks hold. The planner packs each rack on its own and pools
        only every rack's leftovers (planner.py, point 2), so ``g`` full racks whose
        leftovers make whole replicas can be taken out and counted by arithmetic."""
        if not self.node_level or self.exact:
            return key, 0
        per_rack, per_replica = self.job.nodes_per_rack, self.job.pp
        rem = per_rack % per_replica
        g = per_replica // math.gcd(rem, per_replica) if rem else 1
        full = dict(key).get(per_rack, 0)
        keep = full if full < 2 * g else full % g + g
        out = tuple((c, keep if c == per_rack else n) for c, n in key if c != per_rack or keep)
        taken = full - keep
        return out, taken * (per_rack // per_replica) + taken * rem // per_replica

    def plan(self, key: tuple) -> LayoutPlan | None:
        """The planner's layout of every whole replica on ``key``'s nodes (no DP limits)."""
        if key not in self._plans:
            self.planner_calls += 1
            job, nodes = self.job, []
            gpus = 1 if self.node_level else job.gpus_per_node
            counts = [count for count, n_racks in key for _ in range(n_racks)]
            for r, count in enumerate(counts):
                nodes += [NodeInfo(f"r{r}n{i}", gpus=gpus, labels={"rack": f"r{r}"}) for i in range(count)]
            tp = 1 if self.node_level else job.tp
            try:
                plan = plan_layout(ClusterTopology(nodes), tp, job.pp)
            except InfeasibleError:
                plan = None
            self._plans[key] = plan
        return self._plans[key]

    def replicas(self, key: tuple) -> int:
        """Whole replicas the healthy nodes hold (planner.plan_layout, rack-aware)."""
        if key not in self._replicas:
            small, extra = self.reduce(key)
            plan = self.plan(small)
            self._replicas[key] = (plan.max_replicas if plan else 0) + extra
        return self._replicas[key]

    def dp(self, key: tuple) -> int | None:
        """The largest allowed DP in whole replicas on these nodes (scaling + batch policy)."""
        return policies.target_dp(self.replicas(key), self.allowed)

    def survivors(self, key: tuple, dp: int) -> int:
        """DP left when one node of a running layout at ``dp`` is lost: the replicas
        planner.drop_nodes removes, then the largest allowed DP below what is left."""
        if key not in self._drops:
            plan = self.plan(self.reduce(key)[0])
            if plan is None:
                self._drops[key] = 1
            else:
                try:
                    self._drops[key] = plan.dp - drop_nodes(plan, [plan.ranks[0].node]).max_replicas
                except InfeasibleError:
                    self._drops[key] = plan.dp
        return policies.target_dp(dp - self._drops[key], self.allowed) or 0

    def grow(self, dp: int, key: tuple) -> int | None:
        decision = policies.scaling_decision(dp, self.replicas(key), self.allowed)
        return decision.dp if isinstance(decision, policies.ResizeDecision) and decision.dp > dp else None

    def step_s(self, dp: int, full_step_s: float) -> float:
        job = self.job
        return (
            full_step_s
            * batch.grad_accum(job.batch, job.micro_batch, dp)
            / batch.grad_accum(job.batch, job.micro_batch, self.allowed[-1])
        )

    def budget_left(self, failures: int) -> bool:
        if self.job.max_failures is None:
            return True
        return policies.failure_decision(failures, self.job.max_failures) is policies.FailureDecision.RETRY


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
        if self.waiting_since is not None:
            self.acc["wait_capacity"] += t - self.waiting_since
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
            self.acc["wait_capacity"] += ev.t - self.waiting_since
            self.waiting_since = None
            if self.pending is None:  # the job never started
                self.pending = {"t": ev.t, "cause": "start", "detect_s": 0.0, "lost_work_s": 0.0, "dp_before": 0}
            self._plan_recovery(ev.t, self.pending["cause"], self.pending.get("survivors", 0))
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
            self.acc["wait_capacity"] += self.end - self.waiting_since
        if self.failed_at is not None:
            self.acc["job_failed"] += self.end - self.failed_at
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
