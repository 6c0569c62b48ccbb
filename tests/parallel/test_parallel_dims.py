"""Pure tests of the topology object and the pipeline split (no process group)."""

from __future__ import annotations

import pytest

from elastic.errors import SpecError
from elastic.models.gpt import GPT, ModelConfig
from elastic.models.spec import build_stage_module
from elastic.parallel.dims import ParallelDims
from elastic.parallel.pp import bubble_fraction, stage_layers

CFG = ModelConfig(n_layers=4, d_model=32, n_heads=4, vocab_size=64, seq_len=16)


@pytest.mark.timeout(240)
def test_rank_order_is_dp_pp_tp_with_tp_fastest():
    dims = ParallelDims(dp=2, tp=2, pp=3, world_size=12)
    seen = []
    for rank in range(12):
        dp_rank, pp_rank, tp_rank = dims.coords(rank)
        assert rank == ((dp_rank * 3) + pp_rank) * 2 + tp_rank
        assert dims.rank_of(dp_rank, pp_rank, tp_rank) == rank
        seen.append((dp_rank, pp_rank, tp_rank))
    assert seen[:4] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)]
    assert len(set(seen)) == 12


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"dp": 2, "tp": 2, "pp": 1, "world_size": 8}, "parallel"),
        ({"dp": 0, "tp": 1, "pp": 1, "world_size": 0}, "parallel.dp"),
        ({"dp": 1, "tp": 1, "pp": 1, "world_size": 1, "cp": 0}, "parallel.cp"),
        ({"dp": 1, "tp": 1, "pp": 1, "world_size": 2, "ep": 2, "cp": 2}, "parallel"),
    ],
)
def test_degrees_must_match_world(kwargs, field):
    with pytest.raises(SpecError) as err:
        ParallelDims(**kwargs)
    assert err.value.field == field


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("tp", "pp", "cfg", "field"),
    [
        (3, 1, CFG.model_copy(update={"n_heads": 4, "d_model": 48}), "parallel.tp"),  # tp ∤ n_heads
        (8, 1, CFG.model_copy(update={"n_heads": 8, "d_model": 36}), "parallel.tp"),  # tp ∤ d_model
        (1, 3, CFG, "parallel.pp"),  # pp ∤ n_layers
        (1, 2, CFG.model_copy(update={"tie_embeddings": True}), "model.tie_embeddings"),
    ],
)
def test_validation_against_model_names_the_field(tp, pp, cfg, field):
    dims = ParallelDims(dp=1, tp=tp, pp=pp, world_size=tp * pp)
    with pytest.raises(SpecError) as err:
        dims.validate_model(cfg)
    assert err.value.field == field


@pytest.mark.timeout(240)
def test_grad_accum_keeps_global_batch_exact():
    assert ParallelDims.from_world(8, tp=2).grad_accum(global_batch=48, micro_batch=4) == 3
    with pytest.raises(SpecError) as err:
        ParallelDims.from_world(4).grad_accum(global_batch=10, micro_batch=2)
    assert err.value.field == "train.global_batch"


@pytest.mark.timeout(240)
def test_mesh_needs_a_process_group():
    with pytest.raises(RuntimeError):
        ParallelDims(dp=1, tp=1, pp=1, world_size=1).world_mesh  # noqa: B018


@pytest.mark.timeout(240)
def test_stage_modules_keep_full_model_fqns():
    full = set(dict(GPT(CFG).named_parameters()))
    stages = [set(dict(build_stage_module(GPT(CFG), 2, r).named_parameters())) for r in range(2)]
    assert stages[0] | stages[1] == full
    assert not stages[0] & stages[1]
    assert "tok_emb.weight" in stages[0] and "blocks.1.attn.wq.weight" in stages[0]
    assert "head.weight" in stages[1] and "blocks.2.attn.wq.weight" in stages[1]
    assert list(stage_layers(8, 4, 3)) == [6, 7]
    assert bubble_fraction(4, 8) == pytest.approx(3 / 8)
