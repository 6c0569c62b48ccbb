"""What the GPU check knows about the device it runs on: names, versions, peak FLOP/s.

Runs in the check's driver process (``runner.py``) and in every part's process.
"""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
from typing import Any

# Dense bf16 tensor-core peak per device, FLOP/s. The vendors' datasheets give the figures
# "with sparsity"; dense is half of them. Matched in order against the device name.
BF16_DENSE_PEAK = (
    ("H100 PCIe", 756.0e12),
    ("H100 NVL", 835.0e12),
    ("H200 NVL", 835.0e12),
    ("H200", 989.4e12),
    ("H100", 989.4e12),  # H100 SXM5 (device name "NVIDIA H100 80GB HBM3")
    ("A100", 312.0e12),
)
PEAK_SOURCE = (
    "NVIDIA H100 and H200 Tensor Core GPU datasheets: BF16 Tensor Core 1,979 TFLOP/s (SXM) with sparsity, "
    "989.4 dense; H100 PCIe 1,513 / 756.5, H100 NVL and H200 NVL 1,671 / 835; NVIDIA A100 datasheet: 312 dense"
)


def bf16_peak_flops(device_name: str) -> float | None:
    """The device's dense bf16 peak in FLOP/s, or None where it is not in the table (CPU)."""
    return next((peak for key, peak in BF16_DENSE_PEAK if key in device_name), None)


def device_facts() -> dict[str, Any]:
    """Device name, driver, torch, CUDA, cuDNN, NCCL and triton versions, and the date."""
    import torch

    facts: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cpu_count": os.cpu_count(),
    }
    if not torch.cuda.is_available():
        return {**facts, "device": "cpu", "device_name": platform.processor() or platform.machine()}
    props = torch.cuda.get_device_properties(0)
    facts.update(
        device="cuda",
        device_name=props.name,
        device_count=torch.cuda.device_count(),
        capability=f"{props.major}.{props.minor}",
        memory_gib=round(props.total_memory / 2**30, 2),
        sm_count=props.multi_processor_count,
        bf16_peak_tflops=(bf16_peak_flops(props.name) or 0) / 1e12 or None,
        peak_source=PEAK_SOURCE,
        driver=_driver_version(),
    )
    facts["cudnn"] = _maybe(torch.backends.cudnn.version)
    facts["nccl"] = _maybe(lambda: ".".join(str(v) for v in torch.cuda.nccl.version()))
    facts["triton"] = _maybe(lambda: __import__("triton").__version__)
    return facts


def _maybe(fn: Any) -> Any:
    """A version that may be missing: None rather than a failed part."""
    try:
        return fn()
    except Exception:
        return None


def _driver_version() -> str | None:
    """The NVIDIA driver's version, from nvidia-smi or the kernel module."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.TimeoutExpired):
        pass
    try:
        with open("/proc/driver/nvidia/version") as f:
            return f.readline().strip()
    except OSError:
        return None


def sync(device: Any) -> None:
    """Wait for the device's queued work (a timing must not end before the GPU does)."""
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def peak_memory_reset(device: Any) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats()


def total_memory_bytes(device: Any) -> int | None:
    import torch

    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_properties(0).total_memory
    return None
