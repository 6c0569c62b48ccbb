"""A CPU worker's ``malloc`` keeps what it frees (elastic/worker/allocator.py): blocks under
32 MiB freed stay resident for the next allocations, where glibc's defaults hand them back.
Each case runs in its own interpreter: the setting is process-wide."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)

PROBE = """
import sys, torch
from elastic.worker.allocator import keep_freed_memory
kept = keep_freed_memory()
def rss(): return int(open("/proc/self/statm").read().split()[1]) * 4096 >> 20
base = rss()
blocks = [torch.ones(4 << 20) for _ in range(4)]  # 4 x 16 MiB, every page touched
held = rss() - base
del blocks
print(kept, held, rss() - base)
"""


def _probe(env_value: str | None) -> tuple[bool, int, int]:
    env = {"PATH": "/usr/bin:/bin"}
    if env_value is not None:
        env["ELASTIC_KEEP_FREED_MEMORY"] = env_value
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr[-2000:]
    kept, held, after = out.stdout.split()
    return kept == "True", int(held), int(after)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_blocks_stay_resident_unless_turned_off():
    kept, held, after = _probe(None)
    assert kept and held >= 60 and after >= held - 2, (held, after)  # nothing handed back
    kept, held, after = _probe("0")
    assert not kept and held >= 60 and after <= 8, (held, after)  # glibc's defaults: unmapped on free
