"""A CPU worker keeps the memory it frees for its next allocations (glibc's ``malloc``).

By default glibc hands freed memory back to the kernel: a block it mapped on its own
(above its mmap threshold, which starts at 128 KiB) is unmapped when freed, and the top of
a heap is trimmed once more than its trim threshold lies free there. Every page of the next
allocation of that size is then faulted in, and zeroed, again. A re-formation frees and
allocates buffers the size of the training state: a DDP wrapper's gradient buckets, the
gradients, FSDP's unsharded parameters; so its cost grew with the state (issue 29: freeing
a DDP wrapper's buckets took 13-48 ms per rank at 500 MB of state, 0.2-3 ms at 50 MB, in
instrumented 4-rank recoveries on 2 cores, 2026-11-27).

``keep_freed_memory`` sets glibc's mmap threshold to its largest value (32 MiB on 64-bit:
larger blocks are still mapped and unmapped one by one) and its trim threshold out of
reach, so freed blocks stay in the process's heaps for the allocations that follow, as
CUDA's caching allocator keeps device memory. The cost: a worker's resident memory does not
shrink below its high-water mark (which a training step reaches again at each step).
Set ``ELASTIC_KEEP_FREED_MEMORY=0`` in the workers' environment to keep glibc's defaults.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # glibc's <malloc.h>
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit: larger values are refused
TRIM_NEVER = 0x7FFFFFFF  # mallopt takes a C int: the largest, beyond a thread heap's 64 MiB
ENV = "ELASTIC_KEEP_FREED_MEMORY"


def keep_freed_memory(device_type: str = "cpu") -> bool:
    """Tune this process's ``malloc`` to keep what it frees; True if it did (glibc only, and
    for a CPU worker only: a GPU worker's state lives in CUDA's caching allocator already)."""
    if device_type != "cpu" or os.environ.get(ENV, "1") == "0" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
        mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
        return mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_NEVER) == 1
    except (OSError, AttributeError) as exc:  # no such library or symbol: keep the defaults
        logger.debug("mallopt: %s", exc)
        return False
