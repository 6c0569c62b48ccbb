"""``TrainEngine.forward_backward_agree``: the stop flag is read once the rank's own forward
and backward are done, so a stop asked while a step computes ends that step (a grow-back,
a drain or a graceful stop then waits for the step in flight only, not for one more)."""

from __future__ import annotations

import pytest
import torch

from elastic.engine import TrainEngine
from elastic.models.config import GPTConfig
from elastic.optim import TrainConfig
from elastic.parallel.config import ParallelConfig
from elastic.testing.single_rank import SingleRank

pytestmark = [pytest.mark.timeout(60), pytest.mark.cluster]  # a process group of one rank


def test_the_flag_is_read_after_the_ranks_own_forward_and_backward():
    model = GPTConfig(n_layers=1, d_model=16, n_heads=2, vocab_size=32, seq_len=8)
    rank = SingleRank("cpu")
    dims = rank.join()
    try:
        engine = TrainEngine(model, ParallelConfig(micro_batch=2), TrainConfig(steps=2, global_batch=2), dims, 0)
        order: list[str] = []
        engine.module.register_forward_hook(lambda *_: order.append("forward"))
        next(iter(engine.module.parameters())).register_hook(lambda g: order.append("backward"))

        def asked() -> bool:  # a stop asked while the step computed
            order.append("flag")
            return "backward" in order

        tokens = torch.randint(0, model.vocab_size, (2, model.seq_len + 1), generator=torch.Generator().manual_seed(0))
        _, stop = engine.forward_backward_agree([(tokens[:, :-1], tokens[:, 1:])], asked)
        assert stop and order == ["forward", "backward", "flag"], order
        order.clear()
        _, stop = engine.forward_backward_agree([(tokens[:, :-1], tokens[:, 1:])], lambda: False)
        assert not stop
    finally:
        rank.close()
