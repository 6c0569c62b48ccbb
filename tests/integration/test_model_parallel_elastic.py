"""Elasticity with model parallelism: a dp 2 x tp 2 job loses a node and goes on at dp 1 x tp 2."""

from __future__ import annotations

import pytest
from elastic_testlib import (
    REL_SAME_ORDER,
    assert_matches_reference,
    elastic_spec,
    events_of,
    single_rank_metrics,
    step_metrics,
)

from elastic import ElasticTrainer
from elastic.faults import Fault, FaultInjector

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(300)]

STEPS = 16


def _spec(**elastic):
    # A long collective timeout: survivors blocked in a TP or DP sub-group collective must be
    # freed by the failed ranks leaving the group, not by this timeout.
    spec = elastic_spec(max_dp=2, collective_timeout_s=60, **elastic)
    spec.parallel.tp = 2
    spec.train.steps = STEPS
    return spec


def test_dp2_tp2_loses_a_node_and_continues_at_dp1(ray_cluster, tmp_path):
    # Fault-free reference: the same job (seed, data, global batch) trained by one rank in this
    # process (tp 1, dp 1), not a second cluster run.
    reference = single_rank_metrics(_spec(min_dp=2), str(tmp_path / "ref-data"))

    injector = FaultInjector([Fault("kill_node", at_step=6, node_index=2)], cluster=ray_cluster)
    spec = _spec()
    trainer = ElasticTrainer(spec, run_dir=str(tmp_path / "run"), callbacks=[injector])
    result = trainer.fit()
    assert result.status == "succeeded" and result.steps == STEPS
    assert [f["cause"] for f in events_of(trainer.run_dir, "failure")] == ["node_lost"]
    assert [dp for _, dp in result.dp_history] == [2, 1]
    steps = events_of(trainer.run_dir, "step")
    assert {(e["tp"], e["world_size"]) for e in steps if e["dp"] == 1} == {(2, 2)}
    print("recoveries:", result.recoveries)
    assert result.recoveries[0].lost_steps == 0
    # Not the 60 s collective timeout: survivors are freed by the failed ranks leaving.
    assert result.recoveries[0].recover_s < spec.elastic.collective_timeout_s, result.recoveries
    # dp 2 -> dp 1 at tp 2 against the fault-free single-rank run (measured: printed).
    assert_matches_reference(step_metrics(trainer.run_dir), reference, rel=REL_SAME_ORDER, steps=STEPS)
