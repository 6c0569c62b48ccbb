"""A device's dense peak FLOP/s, for MFU. Runs in the worker (``actor.py`` reads it once per
configure); pure lookup, no state."""

from __future__ import annotations

import torch

# Dense peak FLOP/s per device and compute precision, for MFU (vendor data sheets, SXM parts);
# None where unknown (CPU). bf16 is the default on CUDA (``train.dtype``).
_PEAK = {
    "bf16": {"H200": 989.4e12, "H100": 989.4e12, "A100": 312e12, "L40S": 362.05e12},
    "fp32": {"H200": 494.7e12, "H100": 494.7e12, "A100": 156e12, "L40S": 183e12},  # TF32 tensor cores
}


def peak_flops(device: torch.device, dtype: str = "fp32") -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in _PEAK.get(dtype, {}).items() if k in name), None)
