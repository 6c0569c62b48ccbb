"""Elasticity with expert and context parallelism: a 4-node job (dp 2 x ep 2, or dp 2 x cp 2)
loses a node, goes on at dp 1 from the survivors' memory snapshots, and ends on the
fault-free losses and gradient norms (one rank trained in the test's process:
``single_rank_metrics``).

A replica is ep x cp x tp x pp workers (2 here), so the lost node takes one replica. Under
EP the two ranks of a replica hold different experts, under CP the same parameters; with
DDP (zero 0) the other replica holds the same state either way, which
``elastic/control/recovery_plan.py`` must see. (With zero >= 1 every rank's shard is unique and
comes back from its copy in the other replica: 0 or 1 steps lost, as for every FSDP layout,
tests/integration/test_node_loss.py.)
"""

from __future__ import annotations

import copy

import pytest
from elastic_testlib import REL_SAME_ORDER, assert_matches_reference, events_of, single_rank_metrics, step_metrics

from elastic import ElasticTrainer
from elastic.faults import Fault, FaultInjector
from jobs import JobSpec

pytestmark = [pytest.mark.slow, pytest.mark.cluster, pytest.mark.timeout(300)]

STEPS = 12
TINY_MOE = {"n_experts": 4, "top_k": 2, "shared_expert": True, "expert_hidden": 32, "aux_loss_coef": 0.1}


def _spec(parallel: dict, moe: dict | None, **elastic) -> JobSpec:
    raw = {
        "name": "moe-cp-elastic",
        "seed": 1,
        "model": {"kind": "llama", "size": "tiny", "moe": moe},
        "data": {"num_samples": 4000},
        "parallel": {"micro_batch": 1, **parallel},
        "elastic": {
            "min_dp": 1,
            "max_dp": 2,
            "heartbeat_timeout_s": 4,
            # Long: survivors blocked in an EP all-to-all or a CP all-gather must be freed by
            # the lost ranks leaving the group, not by this timeout.
            "collective_timeout_s": 60,
            "max_failures": 5,
            "min_dp_wait_s": 20,
            **elastic,
        },
        "train": {"steps": STEPS, "global_batch": 12, "lr": 3.0e-3},
        "checkpoint": {"every_steps": 0, "memory_every_steps": 1},
    }
    return JobSpec.from_dict(copy.deepcopy(raw))


@pytest.mark.parametrize(
    ("parallel", "moe"),
    [({"ep": 2}, TINY_MOE), ({"cp": 2}, None)],
    ids=["moe_ep2", "llama_cp2"],
)
def test_node_loss_resizes_dp_in_whole_replicas_and_loses_no_step(ray_cluster, tmp_path, parallel, moe):
    # Fault-free reference: the same job trained by one rank in this process (ep, cp 1, dp 1),
    # not a second cluster run.
    reference = single_rank_metrics(_spec(parallel, moe, min_dp=2), str(tmp_path / "ref-data"))

    injector = FaultInjector([Fault("kill_node", at_step=5, node_index=2)], cluster=ray_cluster)
    spec = _spec(parallel, moe)
    trainer = ElasticTrainer(spec, run_dir=str(tmp_path / "run"), callbacks=[injector])
    result = trainer.fit()
    assert result.status == "succeeded" and result.steps == STEPS
    assert [f["cause"] for f in events_of(trainer.run_dir, "failure")] == ["node_lost"]
    assert [dp for _, dp in result.dp_history] == [2, 1]
    assert {e["world_size"] for e in events_of(trainer.run_dir, "step") if e["dp"] == 1} == {2}
    print("recoveries:", result.recoveries)
    assert result.recoveries[0].lost_steps == 0
    assert events_of(trainer.run_dir, "restore")[0]["source"] == "memory"
    assert result.recoveries[0].recover_s < spec.elastic.collective_timeout_s, result.recoveries
    assert_matches_reference(step_metrics(trainer.run_dir), reference, rel=REL_SAME_ORDER, steps=STEPS)
