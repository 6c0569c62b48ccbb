"""The job's reaction to the cluster (docs/simulate.md), from the project's own code, in the
driver's process: the batch policy (``batch.allowed_dps``, ``batch.grad_accum``), the
placement planner (``planner.plan_layout``: how many whole replicas the healthy nodes hold,
rack-aware; ``planner.drop_nodes``: which replicas survive a loss), the scaling policy
(``policies.target_dp``, ``policies.scaling_decision``: the largest allowed DP in whole
replicas, growing back when capacity returns) and the failure policy
(``policies.failure_decision``: the failure budget).

The planner is called once per distinct rack histogram (how many racks have how many
healthy nodes: the replica count depends on nothing else) and cached; when a TP group is
exactly one node it is called at node granularity (one slot per node, ``tp=1``), which
gives the same replicas eight times faster.
"""

from __future__ import annotations

import math

from elastic.control import policies
from elastic.errors import InfeasibleError
from elastic.parallel import batch
from elastic.placement.planner import LayoutPlan, drop_nodes, plan_layout
from elastic.placement.topology import ClusterTopology, NodeInfo
from elastic.simulator.cluster import Job


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
