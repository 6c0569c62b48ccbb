"""A rank's random-number state (torch CPU, numpy, Python), saved with every snapshot."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def capture_rng() -> dict[str, str]:
    """This process's RNG states as hex strings.

    Strings, not lists of ints: a snapshot copies its plain data every step, and walking
    ~6,000 list items cost about half a millisecond per step.
    """
    np_state = np.random.get_state()  # legacy=True: the MT19937 tuple (a dict only with legacy=False)
    if isinstance(np_state, dict):
        raise TypeError("numpy.random.get_state() gave a dict, not the legacy MT19937 tuple")
    py_state = random.getstate()
    return {
        "torch": torch.get_rng_state().numpy().tobytes().hex(),
        "numpy": np_state[1].astype(np.uint32).tobytes().hex() + f":{np_state[2]}",
        "python": np.asarray(py_state[1], dtype=np.uint64).tobytes().hex(),
    }


def restore_rng(states: dict[str, Any]) -> None:
    """Set the RNG states saved by :func:`capture_rng` (a list of ints for torch: older snapshots)."""
    t = states.get("torch")
    if isinstance(t, str):
        torch.set_rng_state(torch.frombuffer(bytearray(bytes.fromhex(t)), dtype=torch.uint8))
    elif t is not None:
        torch.set_rng_state(torch.tensor(t, dtype=torch.uint8))
    n = states.get("numpy")
    if isinstance(n, str):
        key, pos = n.split(":")
        # No cached Gaussian: the 3-tuple numpy also takes means the same (has_gauss 0, 0.0).
        np.random.set_state(("MT19937", np.frombuffer(bytes.fromhex(key), dtype=np.uint32), int(pos), 0, 0.0))
    p = states.get("python")
    if isinstance(p, str):
        random.setstate((3, tuple(int(x) for x in np.frombuffer(bytes.fromhex(p), dtype=np.uint64)), None))
