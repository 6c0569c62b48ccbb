"""DP ranks are ordered rack by rack; a replica's own rank order is kept (the plan's order,
with the racks the real worker group reads from Ray's node labels)."""

from __future__ import annotations

import pytest
from elastic_testlib import elastic_spec

from elastic.control.recovery_plan import RestoreChoice, plan_reform
from elastic.control.worker_group import Member, WorkerGroup

pytestmark = pytest.mark.timeout(30)


def test_replicas_are_ranked_rack_by_rack():
    spec = elastic_spec()
    spec.parallel.tp = 2
    group = WorkerGroup(spec, "memory://corpus")  # no Ray call until spawn
    group._node_labels = {"a": {"rack": "r1"}, "b": {"rack": "r0"}, "c": {"rack": "r1"}, "d": {"rack": "r0"}}
    members = [Member(actor=None, group=None, bundle=i % 2, node_id=n, ip="", pid=i) for i, n in enumerate("aabbccdd")]
    plan = plan_reform(
        members, 4, 0, RestoreChoice(None, "none"), [], tp=2, pp=1, zero=0, replicate=False, rack_of=group.rack_of
    )
    ordered = plan.members
    assert [m.node_id for m in ordered] == list("bbddaacc")
    assert [m.bundle for m in ordered] == [0, 1] * 4  # TP order inside each replica kept
    racks = [group._node_labels[m.node_id]["rack"] for m in ordered[::2]]
    assert sum(a != b for a, b in zip(racks, racks[1:] + racks[:1])) == 2  # the ring crosses racks twice
