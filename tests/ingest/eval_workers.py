"""Rank body of the eval tests (module level so spawn can import it): the engine's eval loss
over this rank's share of an eval corpus (``elastic.ingest.eval_rows``) at a given layout."""

from __future__ import annotations

from elastic.engine import TrainEngine
from elastic.ingest.eval_rows import eval_micro_batches
from elastic.ingest.parquet_corpus import ParquetCorpus
from elastic.models.config import LlamaConfig
from elastic.optim import TrainConfig
from elastic.parallel.config import ParallelConfig
from elastic.parallel.dims import ParallelDims
from elastic.testing.ranks import init_group

MODEL = LlamaConfig(n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, vocab_size=64, seq_len=16, multiple_of=16)
TRAIN = TrainConfig(steps=4, global_batch=8, lr=0.5, warmup_steps=0)
SEED = 3


def eval_losses(rank: int, world: int, out_dir: str, uris: list[str], zero: int, micro: int) -> list[float]:
    """The eval loss of each corpus in ``uris`` at DP ``world`` (ZeRO stage ``zero``)."""
    init_group(rank, world, f"{out_dir}/store")
    dims = ParallelDims(dp=world, tp=1, pp=1, world_size=world)
    engine = TrainEngine(MODEL, ParallelConfig(zero=zero, micro_batch=micro), TRAIN, dims, SEED)
    shard = dims.data_shard(dims.coords(rank))
    return [engine.eval_loss(eval_micro_batches(ParquetCorpus(u), dims.data_shards, shard, micro)) for u in uris]
