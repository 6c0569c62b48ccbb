"""Rank body for the chat-corpus train test (module level so spawn can import it): a few AdamW
steps of a tiny Llama on rows read from a corpus ``elastic prepare --format chat`` wrote."""

from __future__ import annotations

import os

from elastic.engine import TrainEngine
from elastic.ingest.corpus import BatchLayout, RankStream
from elastic.ingest.parquet_corpus import ParquetCorpus
from elastic.parallel.dims import ParallelDims
from elastic.testing.ranks import init_group
from jobs import JobSpec


def train_steps(rank: int, world: int, out: str, raw: dict) -> dict:
    """``train.steps`` steps at DP ``world`` from the corpus: each step's loss, and the eval loss
    of the first batch before and after."""
    init_group(rank, world, os.path.join(out, "store"))
    spec = JobSpec.from_dict(raw)
    dims = ParallelDims(dp=world, tp=1, pp=1, world_size=world)
    engine = TrainEngine(spec.model, spec.parallel, spec.train, dims, spec.seed)
    layout = BatchLayout(spec.train.global_batch, spec.parallel.micro_batch, world)
    stream = RankStream(ParquetCorpus(spec.data.source), layout, rank, start_batch=0)
    losses, first = [], None
    try:
        for _ in range(spec.train.steps):
            _, micro = stream.next(timeout=60)
            first = first or micro
            losses.append(engine.forward_backward(micro))
            engine.optimizer_step()
    finally:
        stream.close()
    return {"losses": losses, "eval_after": engine.eval_loss(first)}
