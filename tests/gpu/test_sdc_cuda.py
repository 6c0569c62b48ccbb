"""Silent-data-corruption fingerprints on the GPU (``elastic/worker/sdc.py``): computed where
the parameters live, equal to the same arithmetic on the host, and changed by any single
flipped bit, whatever the dtype, size or storage offset."""

from __future__ import annotations

import pytest
import torch
from gpu_testlib import needs_cuda

from elastic.faults import flip_bit
from elastic.worker.sdc import fingerprint, word_sum_fingerprint
from elastic.worker.sdc_vote import twin_groups, vote

pytestmark = [pytest.mark.gpu, needs_cuda, pytest.mark.timeout(120)]


def _params() -> list[torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    big = torch.randn(257, 129, device="cuda", generator=gen)
    odd_bf16 = torch.randn(1003, device="cuda", generator=gen).to(torch.bfloat16)  # 2006 bytes: padded
    backing = torch.randn(17, device="cuda", generator=gen).to(torch.bfloat16)
    mid_word = backing[1:]  # a view starting 2 bytes into its storage, 32 bytes long
    return [big, odd_bf16, mid_word, torch.randn(64, device="cuda", generator=gen)]


def test_cuda_fingerprint_is_computed_on_the_device_and_agrees_with_the_host():
    params = _params()
    on_gpu = fingerprint(params)
    assert on_gpu == word_sum_fingerprint([p.cpu() for p in params])
    assert on_gpu == fingerprint([p.clone() for p in params])  # the bytes, not the storage


def test_any_single_bit_flip_changes_the_cuda_fingerprint():
    base = fingerprint(_params())
    for which in range(4):
        for bit in (0, 7, 15, 30):
            if bit >= 8 * _params()[which].element_size():
                continue
            for index in (0, 5):
                params = _params()
                flip_bit(params[which], bit, index)
                assert fingerprint(params) != base, (which, bit, index)


def test_twin_replicas_on_the_gpu_vote_out_the_corrupted_one():
    replicas = [_params() for _ in range(3)]
    flip_bit(replicas[1][0], 30, 100)  # one bit of one weight on replica 1
    fps = [fingerprint(r) for r in replicas]
    verdict = vote(fps, twin_groups([(0, 0)] * 3))
    assert not verdict.ok and verdict.decided and list(verdict.odd) == [1]
