"""Sides ``raytrain_tuned`` and ``raytrain_default``: Ray Train V2 ``TorchTrainer``
(``num_workers=(1, 4)``, elastic, ``max_failures=3``) training the same model, optimizer,
data order and batch with DDP.

- ``raytrain_tuned``, as a savvy user would run it: ``RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S=5``,
  ``RAY_TRAIN_HEALTH_CHECK_INTERVAL_S=0.2``, Ray health checks every 0.5 s with 3 misses
  (``_system_config``), and a checkpoint every step (the frequency of our memory tier);
- ``raytrain_default``: the same at Ray's and Ray Train's defaults, a checkpoint every 5 steps.

One module for both: the code is the same, the settings come from the driver
(``driver.run_side``). ``raytrain_loop`` runs in Ray Train's workers; the rest in the side's
child process.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from typing import Any

from benchmarks.harness.cluster import start_cluster
from benchmarks.harness.proc import arm_deadline
from benchmarks.harness.results import write_json
from benchmarks.recovery.progress import append_line, kill_rank_node, read_progress, side_inputs
from benchmarks.recovery.scenario import GLOBAL_BATCH, NODES, RAY_TUNED_ENV, first_step_work


def raytrain_loop(config: dict[str, Any]) -> None:
    """The Ray Train training function: the same model, optimizer, data order and batch."""
    import ray
    import ray.train
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from benchmarks.harness.ddp_step import ddp_step
    from elastic.ingest.corpus import BatchLayout, ParquetCorpus
    from elastic.models.gpt import build_model
    from elastic.optim import build_optimizer
    from jobs import JobSpec

    torch.set_num_threads(1)  # as our workers: max(1, int(cpus_per_worker))
    spec = JobSpec.from_dict(config["spec"])
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    progress = config["progress"]

    def log(**rec: Any) -> None:
        append_line(progress, {"ts": time.time(), "rank": rank, "world_size": world, **rec})

    log(kind="start", pid=os.getpid(), node_id=ray.get_runtime_context().get_node_id())
    model = DistributedDataParallel(build_model(spec.model, spec.seed))
    model.train()
    optimizer, scheduler = build_optimizer(model, spec.train)
    params = [p for p in model.parameters() if p.requires_grad]
    start = 0
    ckpt = ray.train.get_checkpoint()
    if ckpt is not None:
        with ckpt.as_directory() as d:
            state = torch.load(os.path.join(d, "state.pt"), weights_only=False)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        start = int(state["step"])
    log(kind="restored", resume_step=start, from_checkpoint=ckpt is not None)

    corpus = ParquetCorpus(spec.data.source)
    layout = BatchLayout(spec.train.global_batch, spec.parallel.micro_batch, world)
    every = config["checkpoint_every"]
    for step in range(start + 1, spec.train.steps + 1):
        rows = [torch.from_numpy(corpus.rows(idx)) for idx in layout.micro_batches(step - 1, rank)]
        micro_batches = [(r[:, :-1], r[:, 1:]) for r in rows]
        loss = ddp_step(model, params, micro_batches, optimizer, scheduler, spec.train.grad_clip)
        log(kind="step", step=step, loss=loss)
        if every and step % every == 0:
            _report_checkpoint(rank, step, model, optimizer, scheduler)
            log(kind="checkpoint", step=step)


def _report_checkpoint(rank: int, step: int, model, optimizer, scheduler) -> None:
    """``ray.train.report`` from every rank, with the state saved by rank 0."""
    import ray.train
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = None
        if rank == 0:
            torch.save(
                {
                    "model": model.module.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(),
                    "step": step,
                },
                os.path.join(tmp, "state.pt"),
            )
            checkpoint = ray.train.Checkpoint.from_directory(tmp)
        ray.train.report({"step": step}, checkpoint=checkpoint)


def raytrain_child(cfg: dict[str, Any]) -> None:
    os.environ["RAY_TRAIN_V2_ENABLED"] = "1"  # the default in Ray 2.60; explicit here
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    side = cfg["side"]
    out: dict[str, Any] = {
        "side": side,
        "checkpoint_every": cfg["checkpoint_every"],
        "env": {k: os.environ.get(k) for k in RAY_TUNED_ENV},
        "system_config": cfg.get("system_config"),
    }
    arm_deadline(cfg["side_timeout"], cfg["out"], out)
    spec, progress = side_inputs(cfg)
    t0 = time.time()
    started = start_cluster(NODES, system_config=cfg.get("system_config"))
    out["cluster_start_s"] = time.time() - t0
    stop = threading.Event()

    def watch() -> None:
        """Driver-side thread: kill rank's node when step k has completed."""
        while not stop.is_set():
            recs = read_progress(progress)
            done = [r["step"] for r in recs if r["kind"] == "step"]
            if done and max(done) >= cfg["kill_step"]:
                kill_rank_node(out, started.cluster, recs, cfg["kill_rank"], max(done))
                return
            time.sleep(0.005)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    trainer = TorchTrainer(
        raytrain_loop,
        train_loop_config={"spec": spec, "progress": progress, "checkpoint_every": cfg["checkpoint_every"]},
        scaling_config=ScalingConfig(num_workers=(1, NODES), use_gpu=False),
        run_config=RunConfig(
            name="recovery-bench",
            storage_path=os.path.join(cfg["work"], "storage"),
            failure_config=FailureConfig(max_failures=3),
        ),
    )
    try:
        result = trainer.fit()
        out["status"] = "succeeded" if result.error is None else "failed"
        if result.error is not None:
            out["error"] = f"{type(result.error).__name__}: {result.error}"
    except Exception as exc:
        out["status"] = "error"
        out["error"] = f"{type(exc).__name__}: {str(exc)[:2000]}"
    finally:
        stop.set()
        watcher.join(timeout=30)
        started.stop()
    out.update(analyse_raytrain(read_progress(progress), out.get("kill_ts")))
    write_json(cfg["out"], out)
    os._exit(0)


def analyse_raytrain(recs: list[dict[str, Any]], kill_ts: float | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if not recs:
        return out
    old = recs[0]["world_size"]
    out["old_size"] = old
    if kill_ts is None:
        return out
    steps = [r for r in recs if r["kind"] == "step"]
    out["last_step_before_kill"] = max((r["step"] for r in steps if r["ts"] <= kill_ts), default=0)
    starts = [r for r in recs if r["kind"] == "start" and r["ts"] > kill_ts]
    restored = [r for r in recs if r["kind"] == "restored" and r["ts"] > kill_ts]
    out["restarts"] = sorted({(r["world_size"], r["resume_step"]) for r in restored})
    smaller = [r for r in steps if r["ts"] > kill_ts and r["world_size"] < old]
    if not smaller:
        return out
    ws = smaller[0]["world_size"]
    first_step = min(r["step"] for r in smaller if r["world_size"] == ws)
    done = [r["ts"] for r in smaller if r["world_size"] == ws and r["step"] == first_step]
    if len(done) != ws:  # not completed by every rank of the new group
        return out
    out["new_size"] = ws
    out["first_step_at_new_size"] = first_step
    out["recovery_s"] = max(done) - kill_ts
    at_size = [(r["step"], r["ts"]) for r in smaller if r["world_size"] == ws]
    out.update(first_step_work(out["recovery_s"], at_size, GLOBAL_BATCH // ws))
    group_starts = [r for r in starts if r["world_size"] == ws]
    group_restored = [r for r in restored if r["world_size"] == ws]
    resume = group_restored[0]["resume_step"] if group_restored else first_step - 1
    out["resume_step"] = resume
    # Lost: every step the old group's workers completed (before or after the kill) beyond the one restored.
    reached = max(r["step"] for r in steps if r["world_size"] == old)
    out["last_step_reached"] = reached
    out["lost_steps"] = max(0, reached - resume)
    bd: dict[str, float] = {}
    if group_starts:
        t_start = min(r["ts"] for r in group_starts)
        # Ray Train records no detection time the benchmark can read: the first part is
        # detection + worker-group teardown + restart (incl. its timeouts) + process-group init.
        bd["detect_and_restart_worker_group"] = t_start - kill_ts
        if group_restored:
            t_rest = max(r["ts"] for r in group_restored)
            bd["build_ddp_and_checkpoint_restore"] = t_rest - t_start
            bd["first_step"] = max(done) - t_rest
    failed_attempts = sorted({r["world_size"] for r in starts if r["world_size"] != ws})
    if failed_attempts:
        out["other_group_sizes_started"] = failed_attempts
    out["breakdown"] = bd
    return out
