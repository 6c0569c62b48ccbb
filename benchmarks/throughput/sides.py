"""The two sides of ``benchmarks/overhead.py``, one repetition each, each in its own process
tree (own session, hard limit) watched by a ``/proc`` CPU sampler: the torchrun baseline
(``benchmarks/torchrun_ddp_baseline.py`` under ``python -m torch.distributed.run``) and ours
(``ElasticTrainer`` on a private embedded Ray, ``ours_child``). Runs in the benchmark's
driver process, and ``ours_child`` in its child. Each run also records its time to first step
(``first_step_s``): from the launch of its process tree (``torchrun``; the child that starts
Ray and ``ElasticTrainer``) to the completion of step 1 by its slowest rank.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

from benchmarks.harness import BENCHMARKS_DIR
from benchmarks.harness.cluster import embedded_cpus, local_ray
from benchmarks.harness.cpu import TreeCPU
from benchmarks.harness.proc import child_env, module_command, run_logged, tail
from benchmarks.harness.stats import least_squares_slope, theil_sen_slope
from elastic.testing.ports import free_port

BASELINE = os.path.join(BENCHMARKS_DIR, "torchrun_ddp_baseline.py")
OURS_CHILD_FLAG = "--_ours-child"


def run_baseline(spec_path: str, corpus: str, workers: int, out_dir: str, timeout: float, warmup: int) -> dict:
    os.makedirs(out_dir, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(workers),
        "--nnodes",
        "1",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        BASELINE,
        "--spec",
        spec_path,
        "--corpus",
        corpus,
        "--out",
        out_dir,
    ]
    env = child_env()
    env["OMP_NUM_THREADS"] = "1"  # what torchrun sets by default for nproc > 1, made explicit
    log = os.path.join(out_dir, "log.txt")
    is_trainer = lambda c: BASELINE in c and "torch.distributed.run" not in c  # noqa: E731
    launched = time.time()
    rc, wall, cpu = run_logged(cmd, timeout, env, log, watch=TreeCPU.watching(is_trainer))
    if rc != 0:
        raise RuntimeError(f"torchrun baseline exited {rc}:\n{tail(log)}")
    ranks = []
    for r in range(workers):
        with open(os.path.join(out_dir, f"rank{r}.json")) as f:
            ranks.append(json.load(f))
    n_steps = len(ranks[0]["steps"])
    ts = [max(rk["steps"][i]["ts"] for rk in ranks) for i in range(n_steps)]
    losses = [sum(rk["steps"][i]["local_loss"] for rk in ranks) / workers for i in range(n_steps)]
    steps = [rk_step["step"] for rk_step in ranks[0]["steps"]]
    step_times = [max(rk["steps"][i]["step_time_s"] for rk in ranks) for i in range(n_steps)]
    extra = {"threads": ranks[0]["threads"], "first_step_s": ts[0] - launched}
    return summarise_run("torchrun", steps, ts, losses, step_times, warmup, wall, cpu, workers, extra=extra)


def run_ours(entry: str, spec_path: str, run_dir: str, timeout: float, warmup: int, side: str = "ours") -> dict:
    """One elastic run: ``python -m <entry> --_ours-child SPEC RUN_DIR`` (``entry`` is the
    benchmark's module, whose ``__main__`` calls ``ours_child``)."""
    log = run_dir + ".log"
    cmd = module_command(entry, OURS_CHILD_FLAG, spec_path, run_dir)
    is_trainer = lambda c: c.startswith("ray::TrainWorker")  # noqa: E731
    launched = time.time()
    rc, wall, cpu = run_logged(cmd, timeout, child_env(), log, watch=TreeCPU.watching(is_trainer))
    if rc != 0:
        raise RuntimeError(f"elastic run exited {rc}:\n{tail(log)}")
    from elastic.events import read_events

    events = read_events(run_dir)
    step_events = [e for e in events if e["kind"] == "step"]
    dps = {e["dp"] for e in step_events}
    resizes = [e for e in events if e["kind"] in ("failure", "resize")]
    if resizes:
        raise RuntimeError(f"the elastic run had failures or resizes, not a steady-state run: {resizes}")
    return summarise_run(
        side,
        [e["step"] for e in step_events],
        [e["ts"] for e in step_events],
        [e["loss"] for e in step_events],
        [e["step_time_s"] for e in step_events],
        warmup,
        wall,
        cpu,
        max(dps),
        extra={"dp": sorted(dps), "first_step_s": step_events[0]["ts"] - launched},
    )


def ours_child(spec_path: str, run_dir: str) -> None:
    """Runs in a fresh process: one ElasticTrainer.fit() on a private embedded local Ray."""
    from elastic import ElasticTrainer
    from jobs import JobSpec

    with open(spec_path) as f:
        spec = JobSpec.from_dict(json.load(f))
    # Started here rather than by ElasticTrainer so that it can never join another
    # developer's running cluster; sized exactly as the trainer's embedded Ray would be.
    with local_ray(embedded_cpus(spec)):
        result = ElasticTrainer(spec, run_dir=run_dir, progress=False).fit()
    if result is None or result.status != "succeeded":
        raise SystemExit(f"elastic run did not succeed: {result}")


def summarise_run(
    side: str,
    steps: list[int],
    ts: list[float],
    losses: list,
    step_times: list[float],
    warmup: int,
    wall: float,
    cpu: TreeCPU,
    trainers: int,
    extra: dict,
) -> dict:
    """One run's figures over its steady window (the steps after ``warmup``)."""
    window = [(s, t) for s, t in zip(steps, ts) if s > warmup]
    inside = [x for s, x in zip(steps, step_times) if s > warmup]
    n = window[-1][0] - window[0][0]
    job_cpu, trainer_cpu = cpu.cpu_between(window[0][1], window[-1][1])
    return {
        "cpu_per_step_s": trainer_cpu / n / trainers,
        "job_cpu_per_step_s": job_cpu / n,
        "side": side,
        "steps": steps,
        "ts": ts,
        "losses": losses,
        "window_steps": len(window),
        "window_s": window[-1][1] - window[0][1],
        "s_per_step": least_squares_slope(window),
        "s_per_step_robust": theil_sen_slope(window),
        "median_step_time_s": statistics.median(inside),
        "wall_s": wall,
        "load": os.getloadavg()[0],
        **extra,
    }
