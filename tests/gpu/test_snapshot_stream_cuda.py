"""The memory tier's CUDA path: the copy to pinned host memory runs on a side stream, after
the work the training stream had queued when the snapshot started, and never holds the
training thread back for that work; a restore from it on the GPU is exact."""

from __future__ import annotations

import time

import pytest
import torch
from gpu_testlib import busy_gpu, needs_cuda, sleep_cycles_per_second, tiny_job

from elastic.checkpoint.memory_tier import MemoryTier

pytestmark = [pytest.mark.gpu, pytest.mark.cluster, needs_cuda, pytest.mark.timeout(120)]  # cluster: NCCL groups

LAYOUT = {"dp": 1, "tp": 1, "pp": 1, "zero": 0}


def test_snapshot_copies_the_update_queued_before_it_without_waiting_for_it():
    rate = sleep_cycles_per_second()
    tier = MemoryTier(device="cuda")
    w = torch.zeros(4 << 20, device="cuda")  # 16 MiB
    state = {"app": {"w": w}}
    for warm in range(3):  # allocates the three pinned buffers; the next snapshot reuses one
        tier.snapshot_async(warm - 3, 0, state, LAYOUT)
        tier.wait()
    # Load the update's kernel now: with CUDA's lazy module loading, the first launch of a
    # kernel waits for the queued work (on the H100 the first add_ after busy_gpu took 0.49 s).
    w.add_(0.0)
    torch.cuda.synchronize()
    busy_gpu(0.5, rate)  # the training stream is busy...
    w.add_(1.0)  # ...so this update (an optimizer step) is still queued when the snapshot starts
    t0 = time.perf_counter()
    tier.snapshot_async(1, 0, state, LAYOUT)
    started_s = time.perf_counter() - t0
    queued = not torch.cuda.current_stream().query()  # the busy work and the update: not done yet
    tier.wait()
    waited_s = time.perf_counter() - t0
    host = tier.get(0, 1).tensors["app/w"]
    assert host.is_pinned()
    assert queued, f"the busy work was done before the snapshot started ({started_s:.3f} s): this test proves nothing"
    assert torch.equal(host, torch.ones_like(host)), "the copy ran before the update queued ahead of it"
    assert started_s < 0.2, f"snapshot_async held the training thread {started_s:.3f} s for queued GPU work"
    assert waited_s > 0.3, f"wait() returned after {waited_s:.3f} s, before the queued work could have finished"


def test_wait_means_the_whole_copy_has_landed_and_later_updates_do_not_reach_it():
    rate = sleep_cycles_per_second()
    tier = MemoryTier(device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(64 << 20, device="cuda", generator=gen)  # 256 MiB: the copy takes milliseconds
    bf = torch.randn(3, 1001, device="cuda", generator=gen).to(torch.bfloat16)
    state = {"app": {"w": w, "bf": bf}, "train": {"step": 1}}
    busy_gpu(0.2, rate)
    tier.snapshot_async(1, 0, state, LAYOUT)
    tier.wait()
    expected_w, expected_bf = w.cpu(), bf.cpu()
    snap = tier.get(0, 1)
    assert torch.equal(snap.tensors["app/w"], expected_w)
    assert torch.equal(snap.tensors["app/bf"], expected_bf) and snap.tensors["app/bf"].dtype == torch.bfloat16
    w.mul_(0.0)  # the next optimizer step, after wait(): the snapshot keeps the old values
    torch.cuda.synchronize()
    assert torch.equal(snap.tensors["app/w"], expected_w)


def test_a_new_generation_restored_from_a_cuda_snapshot_replays_the_same_step(tmp_path):
    """In-place recovery on the GPU, as a worker does it: train with a snapshot every step,
    leave the group (NCCL abort), form the next generation, build a new engine, load step 2's
    snapshot into it and train step 3 again: the same weights and the same loss."""
    from elastic.testing.single_rank import SingleRank, release_device_memory, run_steps, trainer_on

    spec = tiny_job(tmp_path)
    rank = SingleRank("cuda")
    try:
        with trainer_on(rank, spec) as trainer:
            first = run_steps(trainer, 3).reports
            trainer.tier.wait()
            snap = trainer.tier.get(0, 2)
        with trainer_on(rank, spec, restore={0: snap}) as trainer:
            assert trainer.step == 2 and trainer.batch_index == 2
            for name, p in trainer.engine.model.named_parameters():
                assert p.device.type == "cuda"
                assert torch.equal(p.detach().cpu(), snap.tensors[f"app/model/{name}"]), name
            replay = run_steps(trainer, 1).reports
    finally:
        rank.close()
        release_device_memory()
    assert [r.step for r in first] == [1, 2, 3] and [r.step for r in replay] == [3]
    assert replay[0].loss == pytest.approx(first[2].loss, rel=1e-5, abs=0)
    assert first[2].snapshot is not None and first[2].snapshot.bytes > 0
