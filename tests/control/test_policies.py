"""Pure policies: no Ray, no torch.distributed."""

from __future__ import annotations

import math

import pytest

from elastic.control import policies, recovery_plan
from elastic.errors import SpecError
from elastic.parallel import batch
from elastic.worker.anomaly import LossMonitor

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize(
    "failures,budget,expected", [(1, 0, "raise"), (1, 1, "retry"), (3, 3, "retry"), (4, 3, "raise")]
)
def test_failure_decision(failures, budget, expected):
    assert policies.failure_decision(failures, budget).value == expected


@pytest.mark.parametrize(
    "global_batch,micro,lo,hi,expected",
    [
        (48, 4, 1, 4, [1, 2, 3, 4]),
        (48, 4, 1, 8, [1, 2, 3, 4, 6]),
        (40, 4, 1, 4, [1, 2]),
        (7, 4, 1, 4, []),
        (16, 2, 3, 8, [4, 8]),
    ],
)
def test_allowed_dps_keep_global_batch_exact(global_batch, micro, lo, hi, expected):
    allowed = batch.allowed_dps(global_batch, micro, lo, hi)
    assert allowed == expected
    for dp in allowed:
        assert dp * micro * batch.grad_accum(global_batch, micro, dp) == global_batch


def test_grad_accum_refuses_inexact_dp():
    with pytest.raises(SpecError, match="train.global_batch"):
        batch.grad_accum(48, 4, 5)


@pytest.mark.parametrize(
    "available,allowed,expected", [(4, [1, 2, 3, 4], 4), (3, [1, 2, 4], 2), (0, [1, 2], None), (9, [1, 2, 4, 8], 8)]
)
def test_target_dp_whole_replicas(available, allowed, expected):
    assert policies.target_dp(available, allowed) == expected


def test_scaling_decision():
    assert policies.scaling_decision(2, 4, [1, 2, 4]) == policies.ResizeDecision(4)
    assert policies.scaling_decision(2, 3, [1, 2, 4]) == policies.NoopDecision()
    assert policies.scaling_decision(4, 3, [1, 2, 3, 4]) == policies.ResizeDecision(3)


def test_loss_monitor_flags_nan_and_spikes_but_not_descent():
    mon = LossMonitor(spike_factor=6.0, min_history=4)
    assert mon.check(float("nan")) == "nan_loss" and mon.check(math.inf) == "nan_loss"
    for loss in (4.0, 3.8, 3.7, 3.6, 3.5):
        assert mon.check(loss) is None
        mon.accept(loss)
    assert mon.check(3.0) is None  # falling fast is fine
    assert mon.check(3.9) is None  # within the recent spread
    assert mon.check(40.0) == "loss_spike"


@pytest.mark.parametrize(
    "nodes, tp, pp, zero, expected",
    [
        # DDP, one replica per node: every DP twin on another node already holds the state.
        (["a", "b", "c", "d"], 1, 1, 0, [None] * 4),
        # FSDP, one rank per node: each shard is unique; a uniform shift of 1 keeps it balanced.
        (["a", "b", "c", "d"], 1, 1, 3, [1, 2, 3, 0]),
        # FSDP, two ranks per node: the shift that moves every rank off its node is 2.
        (["a", "a", "b", "b"], 1, 1, 2, [2, 3, 0, 1]),
        # DDP dp 1 x tp 2 over two nodes: no twin anywhere, so copies cross nodes.
        (["a", "b"], 2, 1, 0, [1, 0]),
        # DDP dp 3 x tp 2, two replicas on node a: the third, on b, is everyone's twin off-node.
        (["a", "a", "a", "a", "b", "b"], 2, 1, 0, [None] * 6),
        # FSDP dp 3 x tp 2 on nodes a, a, b: no shift clears every node; the least-loaded off-node rank.
        (["a", "a", "a", "a", "b", "b"], 2, 1, 2, [4, 5, 4, 5, 0, 1]),
        # One node: DDP twins in other processes suffice; FSDP shards go to the next process.
        (["a", "a"], 1, 1, 0, [None, None]),
        (["a", "a", "a"], 1, 1, 1, [1, 2, 0]),
        (["a"], 1, 1, 3, [None]),
    ],
)
def test_replica_peers(nodes, tp, pp, zero, expected):
    peers = recovery_plan.replica_peers(nodes, tp, pp, zero)
    assert peers == expected
    for r, p in enumerate(peers):  # a copy never lives on its owner's node when another node exists
        if p is not None and len(set(nodes)) > 1:
            assert nodes[p] != nodes[r]
