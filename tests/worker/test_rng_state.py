"""The RNG states a snapshot carries: captured as strings, restored exactly."""

import random

import numpy as np
import pytest
import torch

from elastic.worker import capture_rng, restore_rng

pytestmark = pytest.mark.timeout(60)


def _draw():
    return torch.rand(4), np.random.rand(4), [random.random() for _ in range(4)]


def test_capture_restore_round_trip_for_torch_numpy_and_python():
    torch.manual_seed(3), np.random.seed(4), random.seed(5)
    _draw()  # move every generator off its seed state
    saved = capture_rng()
    expected = _draw()
    torch.manual_seed(99), np.random.seed(99), random.seed(99)
    restore_rng(saved)
    got = _draw()
    assert torch.equal(expected[0], got[0])
    assert np.array_equal(expected[1], got[1])
    assert expected[2] == got[2]
    assert all(isinstance(v, str) for v in saved.values())  # plain data, cheap to copy every step


def test_restore_accepts_the_older_list_form_of_the_torch_state():
    torch.manual_seed(7)
    state = torch.get_rng_state().tolist()
    expected = torch.rand(3)
    torch.manual_seed(1)
    restore_rng({"torch": state})
    assert torch.equal(torch.rand(3), expected)
