"""The memory tier's CUDA path: pinned host buffers filled on a side stream, and the
engine's ``max_memory_allocated`` peak. Runs only where a CUDA device is present."""

from __future__ import annotations

import pytest
import torch

from elastic.checkpoint.memory_tier import MemoryTier

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.gpu,
    pytest.mark.timeout(120),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

LAYOUT = {"dp": 1, "tp": 1, "pp": 1, "zero": 0}


def test_snapshot_of_cuda_tensors_lands_in_pinned_host_memory_intact():
    tier = MemoryTier(device="cuda")
    weights = torch.randn(1024, 1024, device="cuda")
    state = {"app": {"w": weights}, "train": {"step": 1}}
    tier.snapshot_async(1, 0, state, LAYOUT)
    tier.wait()
    snap = tier.get(0, 1)
    host = snap.tensors["app/w"]
    assert host.device.type == "cpu" and host.is_pinned()
    assert torch.equal(host, weights.cpu())
    # The next snapshot goes to another buffer; the copy of step 1 stays intact until retired.
    # (Compared with a copy taken before the update: (w + 1) - 1 is not w in floating point.)
    step1 = weights.cpu()
    weights.add_(1.0)
    tier.snapshot_async(2, 0, state, LAYOUT)
    tier.wait()
    assert torch.equal(tier.get(0, 2).tensors["app/w"], weights.cpu())
    assert torch.equal(tier.get(0, 1).tensors["app/w"], step1)


def test_engine_reports_the_cuda_peak():
    import datetime
    import os
    import socket

    import torch.distributed as dist

    from elastic.engine import TrainEngine
    from elastic.models.gpt import ModelConfig
    from elastic.optim import TrainConfig
    from elastic.parallel.config import ParallelConfig
    from elastic.parallel.dims import ParallelDims

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1, timeout=datetime.timedelta(seconds=60)
    )
    try:
        cfg = ModelConfig(n_layers=2, d_model=64, n_heads=4, vocab_size=128, seq_len=32)
        engine = TrainEngine(
            cfg,
            ParallelConfig(micro_batch=2),
            TrainConfig(steps=4, global_batch=2, lr=1e-3),
            ParallelDims(dp=1, tp=1, pp=1, world_size=1),
            seed=0,
            device="cuda",
        )
        tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len + 1))
        loss = engine.forward_backward([(tokens[:, :-1], tokens[:, 1:])])
        engine.optimizer_step()
        assert loss > 0 and engine.peak_mem_bytes() == torch.cuda.max_memory_allocated()
        assert engine.peak_mem_bytes() > 0
    finally:
        dist.destroy_process_group()
