"""Per-rank bodies for the SFT loss tests (module level so spawn can import them): masked,
packed rows through the engine at a given layout; one plain SGD step."""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from elastic.engine import TrainEngine
from elastic.ingest.sft_rows import SftRows
from elastic.models.config import LlamaConfig
from elastic.optim import TrainConfig
from elastic.parallel.config import ParallelConfig
from elastic.parallel.dims import ParallelDims
from elastic.testing.ranks import init_group

MODEL = LlamaConfig(n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, vocab_size=64, seq_len=16, multiple_of=16)
TRAIN = TrainConfig(steps=4, global_batch=8, lr=0.5, warmup_steps=0, grad_clip=1e9, optimizer={"name": "sgd"},
                    schedule="constant")  # fmt: skip
SEED = 3


def sft_rows(n: int = 8, width: int = MODEL.seq_len + 1) -> SftRows:
    """Rows of packed documents (1 to 4 per row, lengths at random) with a loss mask that
    keeps about half the targets, and a few rows with none counted at all."""
    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, MODEL.vocab_size, (n, width), generator=g)
    docs = torch.zeros(n, width, dtype=torch.int64)
    for r in range(n):
        cuts = sorted(torch.randperm(width - 2, generator=g)[: r % 4].add(1).tolist())
        for c in cuts:
            docs[r, c:] += 1
    mask = (torch.rand(n, width, generator=g) < 0.5).long()
    mask[n - 1] = 0  # a row that counts nothing
    return SftRows(tokens.numpy(), mask.numpy(), docs.numpy())


def micro_batches(rows: SftRows, lo: int, hi: int, micro: int) -> list[tuple]:
    tokens = torch.from_numpy(rows.tokens)
    targets = torch.from_numpy(rows.targets())
    docs = torch.from_numpy(rows.document_ids)[:, :-1]
    return [(tokens[i : i + micro, :-1], targets[i : i + micro], docs[i : i + micro]) for i in range(lo, hi, micro)]


def sft_step(rank: int, world: int, out_dir: str, dp: int, zero: int, micro: int) -> dict:
    """One step of the engine on this rank's share of ``sft_rows()``: its loss and the full weights after."""
    init_group(rank, world, f"{out_dir}/store")
    dims = ParallelDims(dp=dp, tp=1, pp=1, world_size=world)
    engine = TrainEngine(MODEL, ParallelConfig(zero=zero, micro_batch=micro), TRAIN, dims, SEED)
    rows = sft_rows(TRAIN.global_batch)
    per = TRAIN.global_batch // dp
    loss = engine.forward_backward(micro_batches(rows, rank * per, (rank + 1) * per, micro))
    engine.optimizer_step()
    eval_loss = engine.eval_loss(micro_batches(rows, rank * per, (rank + 1) * per, micro))
    full = get_model_state_dict(engine.model, options=StateDictOptions(full_state_dict=True))
    return {"loss": loss, "eval_loss": eval_loss, "weights": {k: v.detach().clone() for k, v in full.items()}}
