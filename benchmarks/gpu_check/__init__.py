"""The GPU check (``make gpu-check``; docs/gpu.md): every device path on one GPU, in one call.

* ``runner.py``      the driver: one process per part, each under its own time bound; JSON + log
* ``parts.py``       a part's process: its figures and goals, saved as it goes
* ``device.py``      device facts and the dense bf16 peaks MFU is measured against
* ``common.py``      the models and job specs the parts share
* ``tests_part.py``  the ``gpu``-marked tests
* ``throughput.py``  our engine vs a plain PyTorch loop: tokens/s, MFU
* ``memory.py``      the memory model vs ``torch.cuda.max_memory_allocated``
* ``sweep.py``       the sweep's trial body without Tune, one real out-of-memory trial
* ``snapshot.py``    the CUDA -> pinned-CPU memory-tier snapshot as a fraction of step time
"""

from benchmarks.gpu_check.runner import main

__all__ = ["main"]
