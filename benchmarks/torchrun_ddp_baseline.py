"""A plain torchrun DDP training script: the baseline of ``benchmarks/overhead.py``.

Launched as::

    python -m torch.distributed.run --nproc_per_node N --master_port PORT \
        benchmarks/torchrun_ddp_baseline.py --spec SPEC.json --corpus URI --out DIR

It trains the project's GPT with the project's optimizer on gloo, the way a hand-written
script would: ``DistributedDataParallel`` on the default process group, and the step of
``benchmarks/harness/ddp_step.py`` (``no_sync`` for every micro-batch but the last,
global-norm clipping, AdamW + schedule). It reads the same
parquet rows in the same order as the elastic runtime (``BatchLayout``: batch ``b`` is
global samples ``[b*G, (b+1)*G)``, rank ``r`` takes its contiguous slice), so the math of
every step is the same as the elastic run's. Like the runtime, it reads ahead: a
background thread prefetches ``data.prefetch_steps`` batches (the way an expert would
feed a DDP loop, e.g. a DataLoader with workers, kept in-process and one-threaded here so
that both sides use the same cores). What it does not have is everything the
runtime adds: Ray actors, a controller polling for progress, per-step memory snapshots,
the per-step global loss mean and stop agreement.

Every rank writes ``DIR/rank<r>.json``: per-step wall-clock completion times (``ts``, unix
seconds), the process CPU time used so far (``cpu_s``, all threads) and its local loss;
the driver takes the slowest rank per step.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import threading
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from benchmarks.harness.ddp_step import ddp_step
from elastic.ingest.corpus import BatchLayout, ParquetCorpus
from elastic.models.gpt import build_model
from elastic.optim import build_optimizer
from jobs.spec import JobSpec


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", required=True, help="a JobSpec as JSON (the resolved spec of the elastic run)")
    ap.add_argument("--corpus", required=True, help="parquet corpus URI (the same rows the elastic run reads)")
    ap.add_argument("--out", required=True, help="directory for rank<r>.json")
    args = ap.parse_args(argv)

    with open(args.spec) as f:
        spec = JobSpec.from_dict(json.load(f))
    # Same intra-op threads as an elastic worker: max(1, int(cpus_per_worker)).
    torch.set_num_threads(max(1, int(spec.resources.cpus_per_worker)))

    dist.init_process_group(backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    model = DistributedDataParallel(build_model(spec.model, spec.seed, device="cpu"))
    model.train()
    optimizer, scheduler = build_optimizer(model, spec.train)
    params = [p for p in model.parameters() if p.requires_grad]

    corpus = ParquetCorpus(args.corpus, spec.data.storage_options)
    layout = BatchLayout(spec.train.global_batch, spec.parallel.micro_batch, world)
    grad_accum = layout.grad_accum
    if grad_accum < 1 or spec.train.global_batch % (spec.parallel.micro_batch * world):
        raise SystemExit(f"global_batch {spec.train.global_batch} is not divisible by micro_batch*world")

    def read(batch_index: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        out = []
        for idx in layout.micro_batches(batch_index, rank):
            rows = torch.from_numpy(corpus.rows(idx))
            out.append((rows[:, :-1].contiguous(), rows[:, 1:].contiguous()))
        return out

    # Read-ahead, as the elastic workers do: a thread keeps up to prefetch_steps batches ready.
    ahead: queue.Queue = queue.Queue(maxsize=max(1, spec.data.prefetch_steps))

    def reader() -> None:
        for b in range(spec.train.steps):
            ahead.put(read(b))

    threading.Thread(target=reader, daemon=True).start()

    dist.barrier()
    records = []
    t_start = time.time()
    for step in range(1, spec.train.steps + 1):
        t0 = time.perf_counter()
        micro_batches = ahead.get(timeout=300)
        local_loss = ddp_step(model, params, micro_batches, optimizer, scheduler, spec.train.grad_clip)
        records.append(
            {
                "step": step,
                "ts": time.time(),
                "cpu_s": time.process_time(),
                "step_time_s": time.perf_counter() - t0,
                "local_loss": local_loss,
            }
        )

    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(
            {
                "rank": rank,
                "world_size": world,
                "grad_accum": grad_accum,
                "threads": torch.get_num_threads(),
                "t_start": t_start,
                "steps": records,
            },
            f,
        )
    os.replace(path + ".tmp", path)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
