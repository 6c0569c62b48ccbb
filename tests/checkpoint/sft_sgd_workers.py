"""Rank body of the SFT goal test: a masked, packed corpus read by the real reader, one plain
SGD step of the engine from ``model.init_from`` (importable by spawned ranks)."""

from __future__ import annotations

import os

from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from elastic.checkpoint.hf_import import load_init_from, pairs_to_halves
from elastic.engine import TrainEngine
from elastic.ingest.corpus import BatchLayout, RankStream
from elastic.ingest.parquet_corpus import ParquetCorpus
from elastic.parallel.dims import ParallelDims
from elastic.testing.ranks import init_group
from jobs import JobSpec


def sgd_step(rank: int, world: int, out: str, raw: dict) -> dict:
    """One step at DP ``world``; the full weights after it, by Hugging Face name and row layout."""
    init_group(rank, world, os.path.join(out, "store"))
    spec = JobSpec.from_dict(raw)
    dims = ParallelDims(dp=world, tp=1, pp=1, world_size=world)
    engine = TrainEngine(spec.model, spec.parallel, spec.train, dims, spec.seed, restoring=True)
    load_init_from(engine, spec.model.init_from)
    layout = BatchLayout(spec.train.global_batch, spec.parallel.micro_batch, world)
    stream = RankStream(ParquetCorpus(spec.data.source), layout, rank, start_batch=0)
    try:
        _, micro = stream.next(timeout=60)
    finally:
        stream.close()
    loss = engine.forward_backward(micro)
    engine.optimizer_step()
    full = get_model_state_dict(engine.model, options=StateDictOptions(full_state_dict=True))
    adapter = engine.spec.hf
    weights = {}
    for fqn, value in full.items():
        head_dim = adapter.rotary.get(fqn)
        weights[adapter.names[fqn]] = pairs_to_halves(value.detach(), head_dim) if head_dim else value.detach().clone()
    return {"loss": loss, "weights": weights}
