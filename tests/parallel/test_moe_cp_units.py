"""Pure tests of expert and context parallelism: rank order, batch rule, sequence chunks,
the balance loss, the MoE model's invariances, recovery identity and planning (no process group)."""

from __future__ import annotations

import pytest
import torch

from elastic.control import recovery_plan
from elastic.errors import SpecError
from elastic.models.config import LlamaConfig
from elastic.models.moe import balance_loss
from elastic.models.spec import model_spec
from elastic.parallel import batch as policies
from elastic.parallel.cp import chunk_causal_mask, sequence_slice
from elastic.parallel.dims import MeshCoords, ParallelDims, RankCoords, rank_coords, rank_of
from elastic.placement.planner import inner_groupings, plan_groups
from elastic.placement.topology import ClusterTopology, NodeInfo

pytestmark = pytest.mark.timeout(120)

MOE = LlamaConfig(size="tiny", moe={"n_experts": 4, "top_k": 2, "shared_expert": True, "aux_loss_coef": 0.5})


def test_rank_order_is_dp_pp_ep_cp_tp_with_tp_fastest():
    dims = ParallelDims(dp=2, pp=2, ep=2, cp=2, tp=2, world_size=32)
    assert dims.replica_size == 16 and dims.data_shards == 4 and dims.dense_dp == 8 and dims.expert_dp == 4
    seen = set()
    for rank in range(32):
        c = dims.coords(rank)
        assert isinstance(c, MeshCoords)
        assert rank == (((c.dp_rank * 2 + c.pp_rank) * 2 + c.ep_rank) * 2 + c.cp_rank) * 2 + c.tp_rank
        assert dims.rank_of(c.dp_rank, c.pp_rank, c.tp_rank, c.ep_rank, c.cp_rank) == rank
        seen.add(c)
    assert len(seen) == 32
    assert [tuple(dims.coords(r))[2:] for r in range(4)] == [(0, 0, 0), (1, 0, 0), (0, 0, 1), (1, 0, 1)]  # tp, then cp
    assert dims.coords(4).ep_rank == 1 and dims.coords(8).pp_rank == 1 and dims.coords(16).dp_rank == 1
    # a replica is one contiguous block of ranks: the unit the controller adds and removes
    assert {dims.coords(r).dp_rank for r in range(16)} == {0}


def test_layouts_without_ep_and_cp_keep_the_triple():
    c = rank_coords(5, tp=2, pp=3)
    assert isinstance(c, RankCoords) and tuple(c) == (0, 2, 1) and (c.ep_rank, c.cp_rank) == (0, 0)
    assert rank_of(0, 2, 1, tp=2, pp=3) == 5


def test_data_shards_are_dp_times_ep_and_cp_ranks_share_theirs():
    dims = ParallelDims(dp=2, ep=2, cp=2, tp=1, pp=1, world_size=8)
    shards = [dims.data_shard(dims.coords(r)) for r in range(8)]
    assert shards == [0, 0, 1, 1, 2, 2, 3, 3]  # the two CP ranks of a shard read the same samples


def test_global_batch_rule_counts_ep_shards():
    assert policies.allowed_dps(16, 2, 1, 8, ep=2) == [1, 2, 4]  # 8 micro-batches over dp*2 shards
    assert policies.grad_accum(16, 2, dp=2, ep=2) == 2
    with pytest.raises(SpecError) as err:
        policies.grad_accum(12, 2, dp=2, ep=2)
    assert err.value.field == "train.global_batch" and "dp*ep" in str(err.value)
    assert ParallelDims(dp=2, ep=2, tp=1, pp=1, world_size=4).grad_accum(16, 2) == 2


def test_sequence_chunks_cover_the_sequence_once():
    rows = torch.arange(2 * 17).view(2, 17)  # T = 16 tokens and the next one
    parts = [sequence_slice(rows, 4, c) for c in range(4)]
    assert all(p.shape == (2, 5) for p in parts)
    inputs = torch.cat([p[:, :-1] for p in parts], 1)
    targets = torch.cat([p[:, 1:] for p in parts], 1)
    assert torch.equal(inputs, rows[:, :-1]) and torch.equal(targets, rows[:, 1:])
    full = torch.ones(16, 16).tril().bool()
    for c in range(4):
        assert torch.equal(chunk_causal_mask(4, 16, 4 * c, torch.device("cpu")), full[4 * c : 4 * c + 4])


def test_balance_loss_is_one_when_balanced_and_more_when_not():
    probs = torch.full((1, 4, 4), 0.25)
    balanced = torch.tensor([[[0, 1], [2, 3], [0, 2], [1, 3]]])
    assert float(balance_loss(probs, balanced, None)) == pytest.approx(1.0)
    skewed = torch.tensor([[[0, 1]] * 4])
    peaked = torch.tensor([[[0.4, 0.4, 0.1, 0.1]] * 4])
    assert float(balance_loss(peaked, skewed, None)) == pytest.approx(4 * (0.5 * 0.4 * 2))


def test_moe_loss_and_gradients_do_not_depend_on_micro_batching():
    """Dropless routing and a per-sequence balance loss: a batch in one forward gives the
    gradient of the mean of its halves (the basis of every layout's equivalence)."""
    spec = model_spec(MOE)
    tokens = torch.randint(0, MOE.vocab_size, (4, MOE.seq_len + 1), generator=torch.Generator().manual_seed(0))
    x, y = tokens[:, :-1], tokens[:, 1:]

    def grads(parts: int) -> dict[str, torch.Tensor]:
        model = spec.build_full(3)
        spec.set_loss_scale(model, 1.0 / parts)
        for xs, ys in zip(x.chunk(parts), y.chunk(parts)):
            (spec.loss_fn(model(xs), ys) / parts).backward()
        return {n: p.grad for n, p in model.named_parameters()}

    whole, halves = grads(1), grads(2)
    for name, g in whole.items():
        torch.testing.assert_close(halves[name], g, rtol=1e-4, atol=1e-6, msg=name)
    # the balance loss reaches the router: without it the router's gradient differs
    no_aux = LlamaConfig(size="tiny", moe={**MOE.moe.model_dump(), "aux_loss_coef": 0.0})
    model = model_spec(no_aux).build_full(3)
    spec.loss_fn(model(x), y).backward()
    assert not torch.allclose(model.blocks["0"].mlp.router.weight.grad, whole["blocks.0.mlp.router.weight"])


def test_moe_counts_active_experts_in_flops():
    d, h = MOE.d_model, MOE.expert_hidden
    assert MOE.moe_block_params() == d * 4 + (4 + 1) * 3 * d * h  # router, 4 experts, the shared one
    assert MOE.moe_block_params(active=True) == d * 4 + (2 + 1) * 3 * d * h  # top-2 of them per token
    dense = LlamaConfig(**{**MOE.model_dump(), "moe": None})
    extra = MOE.moe_block_params(active=True) - 3 * d * dense.hidden_dim
    assert MOE.flops_per_token() - dense.flops_per_token() == 6.0 * MOE.n_layers * extra


@pytest.mark.parametrize("zero", [0, 1])
def test_recovery_identity_cp_ranks_are_twins_ep_ranks_are_not(zero):
    tp, pp, ep, cp = 1, 1, 2, 2  # replica: ranks (ep, cp) = (0,0) (0,1) (1,0) (1,1)
    shards = [recovery_plan.shard_of(r, tp, pp, zero, ep, cp) for r in range(8)]
    if zero == 0:
        assert shards[0] == shards[1] == shards[4] == shards[5]  # CP ranks and DP replicas: same state
        assert shards[0] != shards[2]  # other experts
        assert recovery_plan.covers([0, 2], 8, tp, pp, zero, ep, cp)  # one CP rank of each EP rank
        assert not recovery_plan.covers([0, 1, 4, 5], 8, tp, pp, zero, ep, cp)  # no copy of experts 2-3
    else:
        assert len(set(shards)) == 8
        assert not recovery_plan.covers([0, 2], 8, tp, pp, zero, ep, cp)


def test_owners_for_reads_its_experts_under_ddp_and_every_shard_under_fsdp():
    members = [object() for _ in range(9)]
    holders = dict(enumerate(members[:8]))
    ddp = recovery_plan.owners_for(3, holders, members[3], 1, 1, 0, ep=2, cp=2)  # new rank 3: ep 1, cp 1
    assert ddp == {3: None}  # its own copy is one of the identical ones
    other = recovery_plan.owners_for(2, holders, members[8], 1, 1, 0, ep=2, cp=2)
    assert len(other) == 1 and recovery_plan.shard_of(next(iter(other)), 1, 1, 0, 2, 2) == (0, 0, 1)
    fsdp = recovery_plan.owners_for(0, holders, members[0], 1, 1, 1, ep=2, cp=2)
    assert set(fsdp) == set(range(8))


def test_replica_peers_need_no_copy_when_a_cp_twin_lives_on_another_node():
    nodes = ["n0", "n1", "n0", "n1"]  # ep=1, cp=2: ranks 0,1 and 2,3 are CP twins on two nodes
    assert recovery_plan.replica_peers(nodes, 1, 1, 0, ep=1, cp=2) == [None] * 4
    nodes = ["n0", "n0", "n1", "n1"]  # ep=2, dp=2: the other replica holds the same experts
    assert recovery_plan.replica_peers(nodes, 1, 1, 0, ep=2, cp=1) == [None] * 4
    nodes = ["n0", "n1"]  # ep=2, dp=1: nobody else holds a rank's experts: a copy on the other node
    assert recovery_plan.replica_peers(nodes, 1, 1, 0, ep=2, cp=1) == [1, 0]


def test_planner_keeps_ep_and_cp_groups_inside_a_node_when_they_fit():
    assert inner_groupings(2, 1, 2, 2) == [(8, 1), (4, 2), (2, 4)]
    nodes = ClusterTopology([NodeInfo(name=f"n{i}", gpus=8) for i in range(2)])
    plan = plan_groups(nodes, tp=2, pp=1, ep=2, cp=2, min_dp=1, max_dp=2)
    assert plan.dp == 2 and len({r.node for r in plan.ranks[:8]}) == 1  # a replica of 8 on one node
    small = ClusterTopology([NodeInfo(name=f"n{i}", gpus=4) for i in range(4)])
    plan = plan_groups(small, tp=2, pp=1, ep=2, cp=2, min_dp=1, max_dp=2)
    assert plan.dp == 2 and plan.tp == 4  # the CP x TP groups stay inside a node, the EP pairs span two
    assert all(len({r.node for r in plan.ranks[i : i + 4]}) == 1 for i in range(0, 16, 4))


@pytest.mark.parametrize(("tp", "ep", "cp"), [(1, 1, 2), (1, 2, 1), (2, 1, 1)])
def test_sharded_state_is_copied_to_another_replica(tp, ep, cp):
    """FSDP, dp 2 on 4 nodes, a replica of 2 ranks: a node loss ends its whole replica, so each
    rank's copy lives in the other replica (a shift of 1 would put rank 0's copy in its own)."""
    assert recovery_plan.replica_peers(["a", "b", "c", "d"], tp, 1, 1, ep=ep, cp=cp) == [2, 3, 0, 1]


def test_sweep_space_takes_ep_and_cp_and_prunes_them_by_memory():
    from elastic.tune.space import Cluster, config_key, default_space, enumerate_space, parse_space
    from jobs.spec import JobSpec

    raw = {
        "model": {"kind": "llama", "size": "tiny", "moe": {"n_experts": 4, "top_k": 2}},
        "parallel": {"micro_batch": 1},
        "elastic": {"min_dp": 1, "max_dp": 4},
        "train": {"global_batch": 8},
    }
    spec = JobSpec.from_dict(raw)
    with pytest.raises(SpecError) as err:
        parse_space({"ep": [3]}, spec)  # 3 does not divide n_experts 4
    assert err.value.field == "space.ep"
    space = parse_space({"ep": [1, 2, 4], "cp": [1, 2]}, spec)
    big = Cluster(worker_slots=4, slots_per_node=4, memory_per_worker_bytes=1 << 40)
    cands = {config_key(c.config): c for c in enumerate_space(spec, space, big)}
    assert cands["dp4-tp1-pp1-z0-mb1"].status == "feasible"
    assert cands["dp2-tp1-pp1-ep2-z0-mb1"].config["grad_accum"] == 2  # 8 samples over dp 2 x ep 2 shards
    assert cands["dp1-tp1-pp1-ep2-cp2-z0-mb1"].status == "feasible"
    too_big = [c for c in cands.values() if (c.config["ep"], c.config["cp"]) == (4, 2)]
    assert [c.status for c in too_big] == ["pruned_batch"]  # a replica of 8 workers does not fit in 4
    # memory: EP divides the experts, so under a budget between the two only EP 4 is left
    by_ep = {c.config["ep"]: c.predicted_mem_bytes for c in cands.values() if c.config["cp"] == 1 and c.config["dp"]}
    assert by_ep[4] < by_ep[2] < by_ep[1]
    tight = Cluster(worker_slots=4, slots_per_node=4, memory_per_worker_bytes=(by_ep[4] + by_ep[2]) / 2)
    kept = [c.config["ep"] for c in enumerate_space(spec, space, tight) if c.status == "feasible"]
    assert kept and set(kept) == {4}
    assert default_space(spec, big)["ep"] == [1, 2, 4]
