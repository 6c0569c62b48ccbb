"""The simulated cluster (docs/simulate.md), in the driver's process: the job and the nodes
it runs on, the failure scenario, and the history of failures and repairs.

The history is exogenous: the same for every strategy, so strategies and checkpoint
intervals are compared on the same failures. Nodes in racks fail as one Poisson process per
node at ``failure_rate`` per 1,000 node-days, with a cause drawn from Llama 3's breakdown;
a failed node comes back ``repair_hours`` later (software failures leave the node usable).
"""

from __future__ import annotations

import heapq
import math
import random
from collections import Counter
from dataclasses import dataclass

from elastic.simulator.costs import CAUSES, LLAMA3_CAUSES, NODE_STAYS

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
