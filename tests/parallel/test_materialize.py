"""Materialising a model in ``parallelize``: the seeded fill runs for a fresh start and is
skipped for a restore (which overwrites every value), and parameters shared between modules
(a tied embedding and head) stay shared either way."""

from __future__ import annotations

import pytest
import torch

from elastic.models.config import GPTConfig, LlamaConfig
from elastic.models.spec import model_spec
from elastic.parallel.config import ParallelConfig
from elastic.parallel.dims import ParallelDims
from elastic.parallel.parallelize import parallelize

CONFIGS = {
    "gpt": GPTConfig(n_layers=2, d_model=32, n_heads=4, vocab_size=64, seq_len=8, tie_embeddings=True),
    "llama": LlamaConfig(
        n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, vocab_size=64, seq_len=8, tie_embeddings=True
    ),
}


def _build(kind: str, restoring: bool, calls: list[int]):
    spec = model_spec(CONFIGS[kind])
    init = spec.init_weights

    def counted(model, seed):
        calls.append(seed)
        init(model, seed)

    spec.init_weights = counted
    with torch.device("meta"):
        model = spec.build()
    dims = ParallelDims(dp=1, tp=1, pp=1, world_size=1)
    return parallelize(model, dims, ParallelConfig(), spec, 7, torch.device("cpu"), restoring=restoring)


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_a_restore_skips_the_fill_and_keeps_the_tie(kind):
    calls: list[int] = []
    model = _build(kind, restoring=True, calls=calls)
    assert calls == []
    assert model.head.weight is model.tok_emb.weight
    assert len(list(model.parameters())) == len(list(model.named_parameters(remove_duplicate=False))) - 1
    with torch.no_grad():  # one table: a write through the head is seen by the embedding
        model.head.weight.fill_(0.5)
    assert torch.equal(model.tok_emb.weight, torch.full_like(model.tok_emb.weight, 0.5))


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_a_fresh_start_fills_from_the_seed(kind):
    calls: list[int] = []
    model = _build(kind, restoring=False, calls=calls)
    assert calls == [7]
    assert model.head.weight is model.tok_emb.weight
    reference = model_spec(CONFIGS[kind]).build_full(7)
    for (name, p), (ref_name, ref) in zip(model.state_dict().items(), reference.state_dict().items()):
        assert name == ref_name and torch.equal(p, ref), name


@pytest.mark.cluster
@pytest.mark.timeout(120)
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_under_fsdp_a_rank_materialises_its_own_shards_only(tmp_path, tied):
    """FSDP shards on the meta device, then each rank allocates only its shard (torchtitan's
    order: a re-formation under HSDP no longer allocates and copies the whole model); a
    model with tied parameters is still materialised whole before sharding, and both give
    the single-process weights from the same seed. A survivor's rebuild takes its kept
    shards as the new parameters' storage: no copy, the same weights after FSDP's lazy init."""
    from parallel_harness import run_ranks
    from parallel_workers import materialised_shards

    results = run_ranks(2, materialised_shards, (tied,), tmp_path)
    for r in results:
        assert r["equal"]
        if tied:
            assert r["allocated"] >= r["total"]
        else:
            assert r["allocated"] <= r["total"] // 2 + 64 * 8  # its half (FSDP pads dim 0 at most a row each)
            assert r["adopted"] == r["params"] and r["adopted_equal"]  # every shard even here: none copied
            assert r["to_empty_calls"] == 0  # nor allocated first and dropped
        # HSDP: one shard mesh for all the parameters, not one each; the weights as before
        assert r["hsdp_params"] > 1 and r["hsdp_shard_meshes"] == 1 and r["hsdp_equal"]
        assert r["slicing_restored"]
