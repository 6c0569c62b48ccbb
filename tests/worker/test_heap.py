"""A worker's settled heap: what its full collections scan after it starts (``elastic/worker/heap.py``).

Each case runs in its own interpreter: freezing the collector's heap is for a process's
whole life, and must not change the test session's own collections.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(120)

SCRIPT = textwrap.dedent(
    """
    import gc, io, sys
    import torch, ray  # what a worker has imported before it settles
    import pyarrow as pa, pyarrow.parquet as pq
    from elastic.worker.heap import LAZY, settle_heap

    frozen = settle_heap(LAZY if sys.argv[1] == "lazy" else ())
    pq.write_table(pa.table({"a": [1, 2]}), io.BytesIO())  # pyarrow's first write imports pandas
    tracked = len(gc.get_objects())

    class Node:
        pass

    a, b = Node(), Node()
    a.other, b.other = b, a  # a cycle made after the freeze is still collected
    del a, b
    print(frozen, tracked, gc.collect())
    """
)


def _settle(mode: str) -> tuple[int, int, int]:
    proc = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr[-2000:]
    frozen, tracked, collected = map(int, proc.stdout.split()[-3:])
    return frozen, tracked, collected


def test_what_a_worker_imports_late_is_frozen_with_the_rest():
    """With pandas preloaded, pyarrow's first write leaves almost nothing for a full
    collection to scan (257 objects here); without, about 30k (pandas' own), which every
    re-formation's collection scanned (33-71 ms per rank, 2026-11-29)."""
    frozen, tracked, collected = _settle("lazy")
    assert frozen > 100_000
    assert tracked < 2_000
    assert collected >= 2  # the cycle: garbage made after the freeze is still found

    _, tracked_without, _ = _settle("none")
    assert tracked_without > 10 * tracked
