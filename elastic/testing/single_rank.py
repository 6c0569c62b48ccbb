"""One rank of a job without Ray: a world-size-1 process group and the worker's own ``Trainer``.

Runs in the calling process, on one device (NCCL on CUDA, gloo on CPU), where Ray is not
installed: the GPU check (``benchmarks/gpu_check``) and the ``gpu``-marked tests use it to
run the device paths of a rank on a single GPU. It does for one rank what ``TrainWorker``
does (``elastic/worker/actor.py``), without the RPCs: join a generation of the group
through ``ReconfigurableProcessGroup`` (the job's ``TCPStore`` served in this process, as
the driver serves it), build the ``ParallelDims`` mesh, build a ``Trainer`` on the synthetic
corpus, train, and after the run or an error drop the engine and leave the group (on NCCL:
abort the communicators), so that the next generation starts from a clean device.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from elastic.checkpoint.memory_tier import MemoryTier, Snapshot
from elastic.ingest.corpus import ParquetCorpus, synthetic_corpus
from elastic.messages import StepReport
from elastic.parallel.dims import ParallelDims
from elastic.worker.hooks import StepHook
from elastic.worker.process_group import ReconfigurableProcessGroup, RendezvousStore
from elastic.worker.trainer import Trainer


def pick_device(kind: str) -> torch.device:
    """``cuda`` (the first visible GPU, made current) or ``cpu``."""
    if kind == "cuda":
        torch.cuda.set_device(0)
        return torch.device("cuda", 0)
    return torch.device("cpu")


def release_device_memory() -> None:
    """Free what a finished (or failed) engine left: Python cycles, then the CUDA cache.

    Call it outside any ``except`` block: a live exception's traceback holds the frames,
    and so the activations, of the step that raised.
    """
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def worker_error(exc: BaseException) -> str:
    """An error as ``TrainWorker`` reports it to the controller (``RunOutcome.detail``)."""
    return f"{type(exc).__name__}: {str(exc)[:300]}"


class SingleRank:
    """This process as rank 0 of a one-rank job, generation after generation."""

    def __init__(self, device: str, collective_timeout_s: float = 60.0):
        self.device = pick_device(device)
        self.store = RendezvousStore("127.0.0.1", collective_timeout_s)
        self.group = ReconfigurableProcessGroup(self.device.type, collective_timeout_s)
        self.generation = 0

    def join(self) -> ParallelDims:
        """Form the next generation (world size 1) and its mesh, as a worker's ``reconfigure`` does."""
        self.generation += 1
        self.group.join(self.generation, 0, 1, self.store.address, self.store.secret)
        self.group.settled()
        dims = ParallelDims(dp=1, tp=1, pp=1, world_size=1, timeout=self.group.rendezvous_timeout)
        dims.build_mesh(self.device.type)
        self.group.mesh_built(dims.mesh_groups())
        return dims

    def leave(self) -> None:
        self.group.leave()

    def close(self) -> None:
        self.group.close()
        self.store.close()


@dataclass
class StepTimes:
    """What ``run_steps`` saw: the trainer's reports and the wall time of each call."""

    reports: list[StepReport] = field(default_factory=list)
    wall_s: list[float] = field(default_factory=list)


@contextlib.contextmanager
def trainer_on(
    rank: SingleRank,
    spec: Any,
    peak_flops: float | None = None,
    hook: StepHook | None = None,
    restore: dict[int, Snapshot] | None = None,
) -> Iterator[Trainer]:
    """A ``Trainer`` for ``spec`` on a new generation of ``rank``'s group, its state loaded
    from ``restore`` (memory-tier snapshots) when given, as a worker's ``reconfigure`` does; on
    exit (normal or not) its stream is closed, its engine dropped and the group left."""
    dims = rank.join()
    d, m = spec.data, spec.model
    uri = synthetic_corpus(d.cache_dir, d.num_samples, m.seq_len, m.vocab_size, spec.seed)
    tier = MemoryTier(rank.device.type)
    trainer = None
    try:
        trainer = Trainer(
            spec, dims, 0, rank.device, tier, ParquetCorpus(uri), collections.deque(), threading.Event(),
            hook=hook, peak_flops=peak_flops,
        )  # fmt: skip
        if restore is not None:
            trainer.load_snapshots(restore)
        trainer.start(0, None)
        yield trainer
        tier.wait()
    finally:
        if trainer is not None:
            trainer.close()
        del trainer, dims
        rank.leave()


def run_steps(trainer: Trainer, steps: int) -> StepTimes:
    """Train ``steps`` more steps; return their step reports and the wall time of each."""
    out = StepTimes()
    for _ in range(steps):
        t0 = time.perf_counter()
        trainer.train_step()
        out.wall_s.append(time.perf_counter() - t0)
        queue = trainer.reports
        if not isinstance(queue, collections.deque):
            raise TypeError("run_steps reads the reports of a trainer made by trainer_on (a deque)")
        while queue:
            report = queue.popleft()
            if isinstance(report, StepReport):
                out.reports.append(report)
    return out
