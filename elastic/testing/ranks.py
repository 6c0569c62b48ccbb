"""The one multi-process harness for tests and benchmarks: N spawned ranks on a gloo group.

``run_ranks(world, fn, args, tmp_dir)`` spawns ``world`` processes (torch.multiprocessing,
spawn start method), runs ``fn(rank, world, out_dir, *args)`` in each, and returns what
``fn`` returned, in rank order. A rank that raises fails the call. ``fn`` joins its gloo
group(s) with ``init_group`` through a file store in ``out_dir`` (no port is picked, so
none can be taken meanwhile); a resize is a second group on a new store file.
"""

from __future__ import annotations

import datetime
import os
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT_S = 60.0


def init_group(rank: int, world: int, store_file: str, timeout_s: float = TIMEOUT_S) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store_file}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def _entry(rank: int, world: int, out_dir: str, fn, args: tuple) -> None:
    torch.set_num_threads(1)
    result = fn(rank, world, out_dir, *args)
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)


def run_ranks(world: int, fn, args: tuple, tmp_dir: Path | str) -> list[Any]:
    """Run ``fn(rank, world, out_dir, *args)`` on ``world`` spawned ranks; their results."""
    out = Path(tmp_dir)
    out.mkdir(parents=True, exist_ok=True)
    mp.start_processes(_entry, args=(world, str(out), fn, args), nprocs=world, join=True, start_method="spawn")
    results = []
    for rank in range(world):
        with open(out / f"rank{rank}.pkl", "rb") as f:
            results.append(pickle.load(f))
    return results
