"""Recovery from a lost node: the elastic runtime against Ray Train V2 (tuned and default),
TorchFT, and Ray Train V2 with TorchFT, side by side, repeated.

The same failure scenario every way, each run on a fresh ``ray.cluster_utils.Cluster`` in
its own child process (private ``TMPDIR``, so nothing else can join it): a head with
``num_cpus=0`` and 4 worker nodes with ``num_cpus=1``, one training process per node, a
GPT of 4.2 M parameters (50.5 MB of training state: fp32 weights plus AdamW's two
moments) on gloo, the same corpus and optimizer. When step ``k`` (default 12) has been
completed, the node that hosts rank (replica) 1 is killed from a driver thread: SIGKILL of
every process that is a child of its raylet, then ``Cluster.remove_node`` (the project's
``kill_node``). The benchmark stamps ``kill_ts`` just before the SIGKILL.

Sides:

- ``ours``: ``ElasticTrainer`` (``min_dp=1, max_dp=4``), memory snapshots every step,
  storage checkpoints every 5 steps. Ray at its defaults (the controller does not wait on
  Ray's node table). A node is added back 1 s after the first step at the new size, to
  time the grow-back (``rejoin_s``: from the node being up to the first step at full size).
- ``raytrain_tuned``: Ray Train V2 ``TorchTrainer`` (``num_workers=(1, 4)``, elastic,
  ``max_failures=3``) as a savvy user would run it: ``RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S=5``,
  ``RAY_TRAIN_HEALTH_CHECK_INTERVAL_S=0.2``, Ray health checks every 0.5 s with 3 misses
  (``_system_config``), and a checkpoint every step (the frequency of our memory tier).
- ``raytrain_default``: the same at Ray's and Ray Train's defaults, a checkpoint every 5 steps.
- ``torchft``: torchft 0.2.0 standalone (``Manager`` + ``LighthouseServer`` with a 1 s
  heartbeat timeout, ``ProcessGroupGloo`` with a 10 s timeout, one ``Manager.allreduce`` of
  the flattened gradients per step, ``should_commit`` before the optimizer step), one
  replica group of one process per node, each a Ray task (``num_cpus=1``) on the same cluster
  shape, started together (each waits until all 4 Managers heartbeat). The
  survivors keep training per step; a node is added back after the first step without the
  lost replica, and a new replica heals from a live peer. Standalone rather than Ray
  Train's ``TorchftConfig``: the project measured the latter to hang after the last step
  (the job never completed), and here every process is under the benchmark's control.
  torchft keeps its own semantics: each replica trains a fixed 3 rows per step, so the
  global batch shrinks from 12 to 9 when a replica is lost (ours and Ray Train keep 12).
  When the kill lands inside a gradient allreduce, the survivors wait for gloo's timeout
  (10 s here; torchft's default is 60 s) before the smaller quorum forms; between two
  allreduces, the lighthouse drops the replica after its 1 s heartbeat timeout.
  torchft must be importable (``make bench-deps``, or ``--torchft-path DIR``); otherwise
  the side is reported as skipped, with the reason.
- ``raytrain_torchft``: Ray Train V2 ``TorchTrainer`` with ``TorchftConfig`` (the Ray-native
  in-place fault tolerance): ``num_workers=4``, each worker its own replica group (Ray
  Train's replica groups are of one worker), one per node; the lighthouse is Ray Train's
  actor on the head node, with ``min_replicas=1``, the same 1 s heartbeat timeout and 10 s
  join timeout as ``torchft``; the training function builds the ``Manager`` (lighthouse
  from ``TORCHFT_LIGHTHOUSE``, the replica group's store from ``MASTER_ADDR/PORT``, both set
  by Ray Train) and trains exactly as ``torchft`` does (3 rows per replica per step, one
  ``Manager.allreduce`` of the gradients, ``should_commit``). Ray Train replaces the lost
  replica group in the dead worker's placement-group slot. This side's head has 1 CPU (Ray
  Train pins the lighthouse actor, which needs 1 CPU to be scheduled, to the head with a hard
  node affinity: with ``num_cpus=0`` there, ``fit()`` fails at start with ControllerError
  "The actor is not schedulable"), and its workers ask for a custom resource that only the
  4 worker nodes carry; the node is added back after the
  first step without it (as for ``torchft``), so the replacement can be placed and heal from
  a live peer (measured: it starts ~16 s after the node is back; when the survivors have
  finished by then, it forms a quorum of one and trains the whole job again alone, and
  ``fit()`` waits for it: ``replacement_solo_steps``). ``fit()`` runs in a thread: a run
  whose ``fit()`` has not returned by the time limit is reported ``completed: false`` with
  the reason (the project saw the job hang after the last step, and a ``ControllerError``
  "actor ... is unavailable"), not as a crash.

Same definitions on every side, from per-step worker progress:

- **recovery** (``downtime``) = from ``kill_ts`` to the first step completed (by every
  rank of the new group) at the smaller size, by the workers' own wall-clock stamps (all
  processes are on this one machine, so they share its clock);
- **lost steps** = the last step any worker completed before the recovery minus the step
  training resumed from (ours: ``summary.json`` ``recoveries[0].lost_steps``, which the
  controller computes from the steps workers reported themselves; Ray Train and TorchFT:
  the progress lines each worker appends after every step).

Each side has a hard time limit; a side that does not recover in time is reported as such.
Every repetition, the medians and ranges, the host, the UTC date and the versions go to a
JSON results file (default ``benchmarks/results/recovery.json``), which ``elastic demo``
quotes. Usage::

    .venv/bin/python benchmarks/recovery_vs_raytrain.py [--reps 3] [--sides ours,raytrain_tuned,...]
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from elastic.control.callbacks import Callback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

NODES = 4
GLOBAL_BATCH = 12  # divisible by every DP degree from 1 to 4 with micro-batch 1
MICRO_BATCH = 1
# ``--model small`` (the default): 4,207,104 parameters, 16.8 MB of fp32 weights + 33.7 MB of
# AdamW moments = 50.5 MB of state. ``--model 10m``: 11,162,240 parameters (134 MB of state).
# ``--model 100m``: 102,305,280 parameters (1.23 GB of state).
# The choice reaches every side's child process through BENCH_RECOVERY_MODEL.
MODELS = {
    "small": {"n_layers": 4, "d_model": 256, "n_heads": 4, "vocab_size": 2048, "seq_len": 32},
    "10m": {"n_layers": 8, "d_model": 320, "n_heads": 5, "vocab_size": 2048, "seq_len": 32},
    "100m": {"n_layers": 14, "d_model": 768, "n_heads": 12, "vocab_size": 2048, "seq_len": 32},
}
MODEL = MODELS[os.environ.get("BENCH_RECOVERY_MODEL", "small")]
SIDES = ("ours", "raytrain_tuned", "raytrain_default", "torchft", "raytrain_torchft")
RAY_TUNED_ENV = {"RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "5", "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.2"}
RAY_TUNED_SYSTEM_CONFIG = {"health_check_period_ms": 500, "health_check_failure_threshold": 3}
TORCHFT_HEARTBEAT_TIMEOUT_MS = 1000
TORCHFT_JOIN_TIMEOUT_MS = 10000
RTFT_NODE_RESOURCE = "bench_worker_node"  # raytrain_torchft: keeps its workers off the head
DEFAULT_RESULTS = os.path.join(ROOT, "benchmarks", "results", "recovery.json")


# --------------------------------------------------------------------------- shared


def _param_count(m: dict[str, Any]) -> int:
    from elastic.models.gpt import ModelConfig, build_model

    return sum(p.numel() for p in build_model(ModelConfig(**m), seed=0).parameters())


def spec_dict(steps: int, corpus_uri: str) -> dict[str, Any]:
    """The job every side trains (Ray Train and TorchFT read the model/optimizer/data fields)."""
    return {
        "name": "recovery-bench",
        "seed": 0,
        "model": dict(MODEL),
        "data": {"source": corpus_uri},
        "parallel": {"micro_batch": MICRO_BATCH},
        "elastic": {"min_dp": 1, "max_dp": NODES},
        "resources": {"cpus_per_worker": 1},
        "train": {"steps": steps, "global_batch": GLOBAL_BATCH, "lr": 3.0e-3},
        "checkpoint": {"every_steps": 5, "memory_every_steps": 1},
    }


def start_cluster(
    system_config: dict[str, Any] | None = None, head_cpus: int = 0, node_resources: dict[str, float] | None = None
):
    import ray
    from ray.cluster_utils import Cluster

    head: dict[str, Any] = {"num_cpus": head_cpus}
    if system_config:
        head["_system_config"] = system_config
    cluster = Cluster(initialize_head=True, head_node_args=head)
    for _ in range(NODES):
        cluster.add_node(num_cpus=1, **({"resources": node_resources} if node_resources else {}))
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False, logging_level=logging.WARNING)
    return cluster


def stop_cluster(cluster) -> None:
    import ray

    try:
        ray.shutdown()
    finally:
        if cluster is not None:
            cluster.shutdown()


def node_index_of(cluster, node_id: str) -> int:
    from elastic.faults import worker_nodes

    ids = [n.node_id for n in worker_nodes(cluster)]
    return ids.index(node_id)


def write_json(path: str, obj: dict[str, Any]) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")
    os.replace(path + ".tmp", path)


def arm_deadline(seconds: float, out_path: str, partial: dict[str, Any]) -> None:
    """In a child: after ``seconds``, write what was measured so far and kill the whole
    process group (this child and its Ray cluster). Nothing outlives the budget."""

    def fire() -> None:
        partial.setdefault("status", "timeout")
        partial["timed_out_after_s"] = seconds
        try:
            write_json(out_path, {k: v for k, v in partial.items() if not callable(v)})
        finally:
            os.killpg(os.getpgid(0), signal.SIGKILL)

    t = threading.Timer(seconds, fire)
    t.daemon = True
    t.start()


def append_line(path: str, rec: dict[str, Any]) -> None:
    """One JSON line, appended atomically (O_APPEND, a single write)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(rec) + "\n").encode())
    finally:
        os.close(fd)


def read_progress(path: str) -> list[dict[str, Any]]:
    try:
        with open(path) as f:
            lines = f.readlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:  # a line being written right now
            pass
    return out


class PidsGroup:
    """The one ``WorkerGroup`` query ``kill_node`` uses: pids known to run on a node."""

    def __init__(self, pids_by_node: dict[str, list[int]]):
        self.pids_by_node = pids_by_node

    def pids_on_node(self, node_id: str) -> list[int]:
        return list(self.pids_by_node.get(node_id, []))


def kill_rank_node(out: dict, cluster, recs: list[dict], rank: int, step: int) -> None:
    """Kill the node that hosts ``rank`` (from the workers' own start records) after ``step``."""
    starts = {r["rank"]: r for r in recs if r["kind"] == "start"}
    node_id = starts[rank]["node_id"]
    pids = [r["pid"] for r in recs if r["kind"] == "start" and r["node_id"] == node_id]
    out["step_at_kill"] = step
    kill_node_now(out, cluster, node_id, pids)


def kill_node_now(out: dict[str, Any], cluster, node_id: str, pids: list[int]) -> None:
    """Stamp ``kill_ts``, SIGKILL the node's processes, remove the node (``kill_node``)."""
    from elastic.faults import kill_node

    index = node_index_of(cluster, node_id)
    out["killed_node_id"] = node_id
    out["kill_ts"] = time.time()
    kill_node(cluster, index, PidsGroup({node_id: pids}))
    out["kill_done_ts"] = time.time()


# --------------------------------------------------------------------------- ours


class KillAndReturn(Callback):
    """Controller callback. When step ``k`` completes, a driver thread kills the node that
    hosts ``rank`` (the controller is not blocked by ``remove_node``); after the first step
    at the smaller DP, a node is added back to time the grow-back."""

    def __init__(self, cluster, out: dict[str, Any], at_step: int, rank: int, return_delay_s: float):
        self.cluster, self.out, self.at_step, self.rank = cluster, out, at_step, rank
        self.return_delay_s = return_delay_s
        self.old_dp: int | None = None
        self.threads: list[threading.Thread] = []
        self.returned = False

    def after_step(self, step: int, group: Any) -> None:
        if self.old_dp is None:
            self.old_dp = group.dp
        if "kill_requested" not in self.out and step >= self.at_step:
            member = next(m for m in group.members if m.rank == self.rank)
            pids = [m.pid for m in group.members if m.node_id == member.node_id]
            self.out["kill_requested"] = True
            self.out["step_at_kill"] = step
            t = threading.Thread(target=kill_node_now, args=(self.out, self.cluster, member.node_id, pids), daemon=True)
            t.start()
            self.threads.append(t)
        elif "kill_done_ts" in self.out and not self.returned and group.dp < self.old_dp and self.return_delay_s >= 0:
            # Ray starts nodes from the main thread only (signal handlers): the controller's
            # thread, here. Workers keep training meanwhile; the rejoin is timed from the
            # moment the node is up.
            due = self.out.setdefault("return_due_ts", time.time() + self.return_delay_s)
            if time.time() >= due:
                self.returned = True
                self.out["node_added_ts"] = time.time()
                self.cluster.add_node(num_cpus=1)
                self.out["node_added_done_ts"] = time.time()


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.created:.3f} {record.getMessage()}")


def ours_child(cfg: dict[str, Any]) -> None:
    from elastic import ElasticTrainer
    from elastic.events import read_events
    from jobs import JobSpec

    out: dict[str, Any] = {"side": "ours"}
    arm_deadline(cfg["side_timeout"], cfg["out"], out)
    with open(cfg["spec"]) as f:
        spec = JobSpec.from_dict(json.load(f))
    run_dir = os.path.join(cfg["work"], "run")
    records = _Records()
    ctl_log = logging.getLogger("elastic.control.controller")
    ctl_log.addHandler(records)
    ctl_log.setLevel(logging.INFO)
    t0 = time.time()
    cluster = start_cluster()
    out["cluster_start_s"] = time.time() - t0
    cb = KillAndReturn(cluster, out, cfg["kill_step"], cfg["kill_rank"], cfg["return_delay_s"])
    try:
        result = ElasticTrainer(spec, run_dir=run_dir, callbacks=[cb], progress=False).fit()
        out["status"] = result.status
        out["summary"] = result.model_dump()
    except Exception as exc:  # report, do not hide: the figures below say what happened
        out["status"] = "error"
        out["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        for t in cb.threads:
            t.join(timeout=60)
        stop_cluster(cluster)
    out.pop("kill_requested", None)
    out["controller_log"] = [line for line in records.lines if "recovery phases" in line or "grew" in line]
    events = read_events(run_dir) if os.path.exists(os.path.join(run_dir, "events.jsonl")) else []
    out.update(analyse_ours(events, out))
    write_json(cfg["out"], out)
    os._exit(0)


def analyse_ours(events: list[dict[str, Any]], out: dict[str, Any]) -> dict[str, Any]:
    res: dict[str, Any] = {}
    kill_ts = out.get("kill_ts")
    steps = [e for e in events if e["kind"] == "step"]
    if not steps or kill_ts is None:
        return res
    old_dp = steps[0]["dp"]
    res["old_size"] = old_dp
    res["last_step_before_kill"] = max((e["step"] for e in steps if e["ts"] <= kill_ts), default=0)
    failures = [e for e in events if e["kind"] == "failure" and e["ts"] >= kill_ts]
    shrink = next(
        (e for e in events if e["kind"] == "resize" and e["ts"] >= kill_ts and e["new_dp"] < e["old_dp"]), None
    )
    if shrink is None:
        return res
    new_dp = shrink["new_dp"]
    restores = [e for e in events if e["kind"] == "restore" and e["ts"] >= kill_ts]
    # The step events carry ``ts`` = the workers' own ``done_at`` (the latest rank's).
    after = [e for e in steps if e["ts"] > kill_ts and e["dp"] == new_dp]
    res["new_size"] = new_dp
    if not after:
        return res
    first = after[0]
    res["first_step_at_new_size"] = first["step"]
    res["recovery_s"] = first["ts"] - kill_ts
    r = restores[0] if restores else None
    if r is not None:
        res["resume_step"] = r["step"]
        res["restore_source"] = r["source"]
    recs = (out.get("summary") or {}).get("recoveries") or []
    if recs:
        res["lost_steps"] = recs[0]["lost_steps"]
        res["summary_recovery"] = recs[0]
    bd: dict[str, float] = {}
    if failures:
        bd["detect"] = failures[0]["ts"] - kill_ts
    if r is not None and failures:
        # failure -> restore event: free survivors, drop replicas, rendezvous, rebuild, restore.
        bd["reconfigure_excl_restore"] = r["ts"] - failures[0]["ts"] - r["duration_s"]
        bd["state_restore"] = r["duration_s"]
        bd["first_step"] = first["ts"] - r["ts"]
    res["breakdown"] = bd
    grow = next((e for e in events if e["kind"] == "resize" and e["ts"] > first["ts"] and e["new_dp"] > new_dp), None)
    if grow is not None and out.get("node_added_done_ts"):
        back = [e for e in steps if e["ts"] > grow["ts"] and e["dp"] == grow["new_dp"]]
        if back:
            res["rejoin_s"] = back[0]["ts"] - out["node_added_done_ts"]
            res["add_node_s"] = out["node_added_done_ts"] - out["node_added_ts"]
            res["rejoin_note"] = (
                "node up (Cluster.add_node returned) -> first step completed at the full size (a new "
                "worker actor spawned, state sent from a live peer's memory)"
            )
    return res


# --------------------------------------------------------------------------- Ray Train


def raytrain_loop(config: dict[str, Any]) -> None:
    """The Ray Train training function: the same model, optimizer, data order and batch."""
    import contextlib

    import ray
    import ray.train
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from elastic.ingest.corpus import BatchLayout, ParquetCorpus
    from elastic.models.gpt import build_model, lm_loss
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
    accum = layout.grad_accum
    every = config["checkpoint_every"]
    for step in range(start + 1, spec.train.steps + 1):
        local = 0.0
        for i, idx in enumerate(layout.micro_batches(step - 1, rank)):
            rows = torch.from_numpy(corpus.rows(idx))
            with contextlib.nullcontext() if i == accum - 1 else model.no_sync():
                loss = lm_loss(model(rows[:, :-1]), rows[:, 1:])
                (loss / accum).backward()
            local += float(loss.detach())
        if spec.train.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, spec.train.grad_clip, foreach=False)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        log(kind="step", step=step, loss=local / accum)
        if every and step % every == 0:
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
                log(kind="checkpoint", step=step)


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
    with open(cfg["spec"]) as f:
        spec = json.load(f)
    progress = os.path.join(cfg["work"], "progress.jsonl")
    t0 = time.time()
    cluster = start_cluster(cfg.get("system_config"))
    out["cluster_start_s"] = time.time() - t0
    stop = threading.Event()

    def watch() -> None:
        """Driver-side thread: kill rank's node when step k has completed."""
        while not stop.is_set():
            recs = read_progress(progress)
            done = [r["step"] for r in recs if r["kind"] == "step"]
            if done and max(done) >= cfg["kill_step"]:
                kill_rank_node(out, cluster, recs, cfg["kill_rank"], max(done))
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
        stop_cluster(cluster)
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


# --------------------------------------------------------------------------- TorchFT


def _torchft_steps(manager, model, optimizer, scheduler, spec, corpus, slot, progress, log, healed, wait_ready):
    """The training loop both TorchFT sides run: start together (``wait_ready``), then per
    step a quorum, this replica's ``slot`` of the global batch, one fault-tolerant allreduce
    of all gradients, and a step only when the Manager commits.

    Not torchft.ddp's DistributedDataParallel: with more than one bucket, its comm hook
    asserts (``assert fut._fut``, ddp.py:76) once a peer died in an earlier bucket's
    allreduce, because the errored Manager then hands back a _DummyWork, and the survivors
    crash instead of skipping the step (seen here in 2 of 7 runs). ``Manager.allreduce``
    averages over the participants and zeroes a healing replica's part.
    """
    import numpy as np
    import torch

    from elastic.models.gpt import lm_loss

    params = [p for p in model.parameters() if p.requires_grad]
    per_replica = spec.train.global_batch // NODES
    n = corpus.num_rows
    log(kind="ready")
    if wait_ready:
        # A replica that asks for a quorum before the others heartbeat forms one alone, and
        # the rest heal from it one by one.
        deadline = time.time() + 120
        while (
            len({r["rank"] for r in read_progress(progress) if r["kind"] == "ready"}) < NODES and time.time() < deadline
        ):
            time.sleep(0.05)
    try:
        while manager.current_step() < spec.train.steps:
            t0 = time.time()
            manager.start_quorum()
            optimizer.zero_grad(set_to_none=True)
            s = manager.current_step()
            first = (s * spec.train.global_batch + slot * per_replica) % max(1, n - per_replica)
            rows = torch.from_numpy(corpus.rows(np.arange(first, first + per_replica)))
            loss = lm_loss(model(rows[:, :-1]), rows[:, 1:])
            loss.backward()
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            manager.allreduce(flat).wait()
            offset = 0
            for p in params:
                p.grad.copy_(flat[offset : offset + p.numel()].view_as(p.grad))
                offset += p.numel()
            committed = manager.should_commit()
            if committed:
                optimizer.step()
                scheduler.step()
            log(
                kind="step",
                step=manager.current_step(),
                committed=bool(committed),
                participants=manager.num_participants(),
                loss=float(loss.detach()),
                started=t0,
                healed_ts=healed["ts"],
            )
    finally:
        # As Ray's example: without it, a replica that finishes can strand a late peer.
        manager.shutdown(wait=False)


def torchft_replica(config: dict[str, Any]) -> dict[str, Any]:
    """One torchft replica group of one process: train until ``steps`` are committed."""
    from datetime import timedelta

    import ray
    import torch
    import torch.distributed as dist
    from torchft import Manager, ProcessGroupGloo

    from elastic.ingest.corpus import ParquetCorpus
    from elastic.models.gpt import build_model
    from elastic.optim import build_optimizer
    from jobs import JobSpec

    torch.set_num_threads(1)
    idx, progress = config["replica"], config["progress"]
    t_start = time.time()

    def log(**rec: Any) -> None:
        append_line(progress, {"ts": time.time(), "rank": idx, **rec})

    log(kind="start", pid=os.getpid(), node_id=ray.get_runtime_context().get_node_id(), started_at=t_start)
    spec = JobSpec.from_dict(config["spec"])
    model = build_model(spec.model, spec.seed)
    model.train()
    optimizer, scheduler = build_optimizer(model, spec.train)
    healed = {"ts": None}

    def load_state_dict(sd: dict[str, Any]) -> None:
        model.load_state_dict(sd["model"])
        optimizer.load_state_dict(sd["optimizer"])
        scheduler.load_state_dict(sd["scheduler"])
        healed["ts"] = time.time()

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=10)),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=1,
        replica_id=f"replica_{idx}",
        store_addr="127.0.0.1",
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=config["lighthouse"],
        hostname="127.0.0.1",
        timeout=timedelta(seconds=10),
        quorum_timeout=timedelta(seconds=60),
        connect_timeout=timedelta(seconds=10),
    )
    corpus = ParquetCorpus(spec.data.source)
    _torchft_steps(
        manager, model, optimizer, scheduler, spec, corpus, idx, progress, log, healed, config.get("wait_ready")
    )
    log(kind="end", step=manager.current_step())
    return {"replica": idx, "step": manager.current_step()}


def torchft_child(cfg: dict[str, Any]) -> None:
    out: dict[str, Any] = {"side": "torchft", "lighthouse_heartbeat_timeout_ms": TORCHFT_HEARTBEAT_TIMEOUT_MS}
    arm_deadline(cfg["side_timeout"], cfg["out"], out)
    try:
        import torchft
        from torchft.coordination import LighthouseServer
    except Exception as exc:
        out.update(status="skipped", error=f"torchft is not importable: {type(exc).__name__}: {exc}")
        write_json(cfg["out"], out)
        os._exit(0)
    import ray

    out["torchft_version"] = getattr(torchft, "__version__", None) or _dist_version("torchft")
    with open(cfg["spec"]) as f:
        spec = json.load(f)
    progress = os.path.join(cfg["work"], "progress.jsonl")
    t0 = time.time()
    cluster = start_cluster()
    out["cluster_start_s"] = time.time() - t0
    # min_replicas=1: the survivors may go on alone. join_timeout 10 s: a healthy replica
    # that is late for a quorum is waited for (as synchronous DDP would), so the quorum moves
    # on without a replica only once its heartbeat has stopped for 1 s.
    lighthouse = LighthouseServer(
        bind="[::]:0",
        min_replicas=1,
        join_timeout_ms=TORCHFT_JOIN_TIMEOUT_MS,
        heartbeat_timeout_ms=TORCHFT_HEARTBEAT_TIMEOUT_MS,
    )
    Replica = ray.remote(num_cpus=1, max_retries=0)(torchft_replica)
    base = {"spec": spec, "progress": progress, "lighthouse": lighthouse.address()}
    refs = {i: Replica.remote(dict(base, replica=i, wait_ready=True)) for i in range(NODES)}
    stop = threading.Event()
    new_ref: list[Any] = []
    return_due: list[float] = []

    def watch() -> None:
        killed = False
        while not stop.is_set():
            recs = read_progress(progress)
            steps = [r for r in recs if r["kind"] == "step" and r["committed"]]
            if not killed:
                full = [r["step"] for r in steps if r["participants"] == NODES]
                if full and max(full) >= cfg["kill_step"]:
                    kill_rank_node(out, cluster, recs, cfg["kill_rank"], max(full))
                    killed = True
            elif cfg["return_delay_s"] >= 0:
                after = [r for r in steps if r["ts"] > out["kill_ts"] and r["participants"] < NODES]
                if after:
                    return_due.append(time.time() + cfg["return_delay_s"])  # the main thread adds the node
                    return
            time.sleep(0.005)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    survivors_done: dict[int, Any] = {}
    try:
        pending = dict(refs)
        deadline = time.time() + cfg["side_timeout"] - 20
        while pending and time.time() < deadline:
            if return_due and not new_ref and time.time() >= return_due[0]:
                # Ray starts nodes from the main thread only (signal handlers).
                out["node_added_ts"] = time.time()
                cluster.add_node(num_cpus=1)
                out["node_added_done_ts"] = time.time()
                new_ref.append(Replica.remote(dict(base, replica=NODES)))
            ready, _ = ray.wait(list(pending.values()), num_returns=1, timeout=0.05)
            for ref in ready:
                i = next(k for k, v in pending.items() if v == ref)
                pending.pop(i)
                try:
                    survivors_done[i] = ray.get(ref)
                except Exception as exc:
                    survivors_done[i] = f"{type(exc).__name__}: {str(exc)[-1500:]}"
        watcher.join(timeout=5.0)  # it returns once the node is back; nothing is left to watch now
        stop.set()
        for ref in new_ref:
            try:
                survivors_done[NODES] = ray.get(ref, timeout=max(1.0, deadline - time.time()))
            except Exception as exc:
                survivors_done[NODES] = f"{type(exc).__name__}: {str(exc)[:200]}"
        out["replica_results"] = {str(k): v for k, v in survivors_done.items()}
        ok = [v for v in survivors_done.values() if isinstance(v, dict)]
        out["status"] = "succeeded" if ok and all(v["step"] >= spec["train"]["steps"] for v in ok) else "failed"
    except Exception as exc:
        out["status"] = "error"
        out["error"] = f"{type(exc).__name__}: {str(exc)[:2000]}"
    finally:
        stop.set()
        lighthouse.shutdown()
        stop_cluster(cluster)
    out["lighthouse_quorums"] = lighthouse_quorums(os.path.join(cfg["work"], "log.txt"))
    out.update(analyse_torchft(read_progress(progress), out))
    write_json(cfg["out"], out)
    os._exit(0)


def analyse_torchft(recs: list[dict[str, Any]], out: dict[str, Any]) -> dict[str, Any]:
    res: dict[str, Any] = {"old_size": NODES}
    kill_ts = out.get("kill_ts")
    if kill_ts is None:
        return res
    steps = [r for r in recs if r["kind"] == "step"]
    committed = [r for r in steps if r["committed"]]
    res["last_step_before_kill"] = max((r["step"] for r in committed if r["ts"] <= kill_ts), default=0)
    survivors = sorted(
        {r["rank"] for r in recs if r["kind"] == "start" and r["rank"] not in (out_rank(out, recs), NODES)}
    )
    smaller = [r for r in committed if r["ts"] > kill_ts and r["participants"] < NODES and r["rank"] in survivors]
    if not smaller:
        return res
    # The first step after the kill that every survivor committed without the lost replica
    # (a smaller quorum of only some survivors may come first when the others are stuck).
    first_step = None
    for step in sorted({r["step"] for r in smaller}):
        if {r["rank"] for r in smaller if r["step"] == step} >= set(survivors):
            first_step = step
            break
    if first_step is None:
        return res
    size = min(r["participants"] for r in smaller if r["step"] == first_step)
    done = [r["ts"] for r in smaller if r["step"] == first_step]
    res["new_size"] = size
    res["first_step_at_new_size"] = first_step
    res["recovery_s"] = max(done) - kill_ts
    # Lost: steps completed (committed) by any worker before the recovery that the new group
    # did not keep. Survivors keep their state in place: resume = last committed step before
    # the first step at the new size.
    before = [r["step"] for r in committed if r["ts"] < min(done) and r["rank"] in survivors]
    resume = first_step - 1
    reached = max([r["step"] for r in committed if r["ts"] <= max(done) and r["participants"] == NODES] + before + [0])
    res["resume_step"] = resume
    res["last_step_reached"] = reached
    res["lost_steps"] = max(0, reached - resume)
    failed = [r for r in steps if r["ts"] > kill_ts and not r["committed"] and r["rank"] in survivors]
    bd: dict[str, float] = {}
    quorum = next(
        (
            q
            for q in out.get("lighthouse_quorums", [])
            if q["created"] > kill_ts and q["size"] == size and q["created"] <= max(done)
        ),
        None,
    )
    if quorum is not None:
        # The lighthouse drops the dead replica once its heartbeat is 1 s old, then forms the
        # smaller quorum (its own stamp); the survivors then reconfigure gloo and finish the step.
        bd["detect_and_quorum"] = quorum["created"] - kill_ts
        bd["pg_reconfigure_and_first_step"] = max(done) - quorum["created"]
    res["breakdown"] = bd
    res["failed_steps_after_kill"] = len({r["step"] for r in failed})
    if out.get("node_added_done_ts"):
        new = [r for r in committed if r["rank"] == NODES and r["participants"] == NODES]
        start = next((r for r in recs if r["kind"] == "start" and r["rank"] == NODES), None)
        if new:
            res["rejoin_s"] = new[0]["ts"] - out["node_added_done_ts"]
            res["add_node_s"] = out["node_added_done_ts"] - out["node_added_ts"]
            res["rejoin_note"] = (
                "node up (Cluster.add_node returned) -> the new replica's first committed step with every "
                "replica (a new process: imports, model build, Manager, then healed from a live peer over HTTP)"
            )
            if start is not None:
                res["rejoin_from_process_start_s"] = new[0]["ts"] - start["started_at"]
            if start is not None and new[0].get("healed_ts"):
                res["heal_state_loaded_after_process_start_s"] = new[0]["healed_ts"] - start["started_at"]
    return res


def lighthouse_quorums(log_path: str) -> list[dict[str, Any]]:
    """The quorums the lighthouse (in this process) logged: id, size, and its own creation stamp."""
    import re

    pat = re.compile(
        r"Quorum! Quorum \{ quorum_id: (\d+), participants: \[(.*)\], "
        r"created: Some\(Timestamp \{ seconds: (\d+), nanos: (\d+)"
    )
    out = []
    try:
        with open(log_path, errors="replace") as f:
            for line in f:
                m = pat.search(line)
                if m:
                    out.append(
                        {
                            "quorum_id": int(m.group(1)),
                            "size": m.group(2).count("QuorumMember {"),
                            "created": int(m.group(3)) + int(m.group(4)) / 1e9,
                        }
                    )
    except OSError:
        pass
    return out


def out_rank(out: dict[str, Any], recs: list[dict[str, Any]]) -> int | None:
    node = out.get("killed_node_id")
    return next((r["rank"] for r in recs if r["kind"] == "start" and r["node_id"] == node), None)


def _dist_version(name: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:
        return None


# --------------------------------------------------------------------------- Ray Train + TorchFT


def raytrain_torchft_loop(config: dict[str, Any]) -> None:
    """The Ray Train V2 training function under ``TorchftConfig``: each worker is its own
    replica group (Ray Train's replica groups are of one worker); the same torchft training
    step as ``torchft_replica`` (one Manager allreduce of the flattened gradients,
    ``should_commit`` before the optimizer step, 3 rows per replica per step)."""
    from datetime import timedelta

    import ray
    import ray.train
    import torch
    from torchft import Manager, ProcessGroupGloo

    from elastic.ingest.corpus import ParquetCorpus
    from elastic.models.gpt import build_model
    from elastic.optim import build_optimizer
    from jobs import JobSpec

    torch.set_num_threads(1)
    progress = config["progress"]
    world_rank = ray.train.get_context().get_world_rank()
    # A replacement of a lost replica group gets the lost worker's world rank again; its
    # progress lines use index NODES (as the standalone side's new replica) so the two
    # processes stay apart in the analysis.
    replacement = any(r["kind"] == "start" and r["rank"] == world_rank for r in read_progress(progress))
    idx = NODES if replacement else world_rank
    t_start = time.time()

    def log(**rec: Any) -> None:
        append_line(progress, {"ts": time.time(), "rank": idx, "world_rank": world_rank, **rec})

    log(kind="start", pid=os.getpid(), node_id=ray.get_runtime_context().get_node_id(), started_at=t_start)
    spec = JobSpec.from_dict(config["spec"])
    model = build_model(spec.model, spec.seed)
    model.train()
    optimizer, scheduler = build_optimizer(model, spec.train)
    healed = {"ts": None}

    def load_state_dict(sd: dict[str, Any]) -> None:
        model.load_state_dict(sd["model"])
        optimizer.load_state_dict(sd["optimizer"])
        scheduler.load_state_dict(sd["scheduler"])
        healed["ts"] = time.time()

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}

    # The lighthouse address comes from TORCHFT_LIGHTHOUSE (set by Ray Train's torchft
    # backend), the replica group's store from MASTER_ADDR/MASTER_PORT (its own
    # one-worker process group): torchft's defaults, as Ray's example uses them.
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=10)),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=1,
        replica_id=f"replica_{idx}_{os.getpid()}",
        rank=0,
        world_size=1,
        timeout=timedelta(seconds=10),
        quorum_timeout=timedelta(seconds=60),
        connect_timeout=timedelta(seconds=10),
    )
    corpus = ParquetCorpus(spec.data.source)
    _torchft_steps(
        manager, model, optimizer, scheduler, spec, corpus, world_rank, progress, log, healed, not replacement
    )
    log(kind="end", step=manager.current_step())


def raytrain_torchft_child(cfg: dict[str, Any]) -> None:
    """Ray Train V2 ``TorchTrainer`` with ``TorchftConfig``: 4 replica groups of 1 worker,
    the lighthouse (an actor on the head node, started by Ray Train) with min_replicas 1 and
    a 1 s heartbeat timeout. ``fit()`` runs in a thread so that the main thread can add a
    node back (Ray starts nodes from the main thread only) and can tell a job that completes
    from one that hangs: ``completed`` is false, with the reason, when ``fit()`` has not
    returned by the side's time limit."""
    os.environ["RAY_TRAIN_V2_ENABLED"] = "1"
    out: dict[str, Any] = {
        "side": "raytrain_torchft",
        "lighthouse_heartbeat_timeout_ms": TORCHFT_HEARTBEAT_TIMEOUT_MS,
        "completed": False,
        "completion_reason": "the side's time limit fired before fit() returned",
    }
    t_armed = time.time()
    arm_deadline(cfg["side_timeout"], cfg["out"], out)
    try:
        import torchft
        from ray.train import FailureConfig, RunConfig, ScalingConfig
        from ray.train.torch import TorchTrainer
        from ray.train.v2.torch.torchft_config import TorchftConfig
    except Exception as exc:
        out.update(status="skipped", error=f"torchft / TorchftConfig is not importable: {type(exc).__name__}: {exc}")
        out["completion_reason"] = "skipped"
        write_json(cfg["out"], out)
        os._exit(0)

    out["torchft_version"] = getattr(torchft, "__version__", None) or _dist_version("torchft")
    with open(cfg["spec"]) as f:
        spec = json.load(f)
    steps_total = spec["train"]["steps"]
    progress = os.path.join(cfg["work"], "progress.jsonl")
    t0 = time.time()
    # Ray Train pins its lighthouse actor (default resources: 1 CPU to be scheduled) to the
    # controller's node with a hard NodeAffinity; the controller runs on the driver's node,
    # the head, and a head with num_cpus=0 (as the other sides use) makes the lighthouse
    # infeasible: fit() fails at start with ControllerError "The actor is not schedulable"
    # (measured here). So this side's head has 1 CPU, and the workers ask for a resource only
    # the 4 worker nodes carry, so that none is placed on the head.
    cluster = start_cluster(head_cpus=1, node_resources={RTFT_NODE_RESOURCE: 1})
    out["cluster_start_s"] = time.time() - t0
    stop = threading.Event()
    return_due: list[float] = []

    def watch() -> None:
        killed = False
        while not stop.is_set():
            recs = read_progress(progress)
            steps = [r for r in recs if r["kind"] == "step" and r["committed"]]
            if not killed:
                full = [r["step"] for r in steps if r["participants"] == NODES]
                if full and max(full) >= cfg["kill_step"]:
                    kill_rank_node(out, cluster, recs, cfg["kill_rank"], max(full))
                    killed = True
            elif cfg["return_delay_s"] >= 0:
                after = [r for r in steps if r["ts"] > out["kill_ts"] and r["participants"] < NODES]
                if after:
                    return_due.append(time.time() + cfg["return_delay_s"])
                    return
            time.sleep(0.005)

    trainer = TorchTrainer(
        raytrain_torchft_loop,
        train_loop_config={"spec": spec, "progress": progress},
        scaling_config=ScalingConfig(
            num_workers=NODES, use_gpu=False, resources_per_worker={"CPU": 1, RTFT_NODE_RESOURCE: 1}
        ),
        torch_config=TorchftConfig(
            lighthouse_kwargs={
                "min_replicas": 1,
                "join_timeout_ms": TORCHFT_JOIN_TIMEOUT_MS,
                "heartbeat_timeout_ms": TORCHFT_HEARTBEAT_TIMEOUT_MS,
            },
            backend="gloo",
        ),
        run_config=RunConfig(
            name="recovery-bench-torchft",
            storage_path=os.path.join(cfg["work"], "storage"),
            failure_config=FailureConfig(max_failures=3),
        ),
    )
    fit_out: dict[str, Any] = {}

    def fit() -> None:
        try:
            result = trainer.fit()
            fit_out["error"] = result.error
        except BaseException as exc:  # ControllerError and the like: report, do not crash
            fit_out["raised"] = exc
        fit_out["done_ts"] = time.time()

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    fitter = threading.Thread(target=fit, daemon=True)
    fitter.start()
    # Leave time to write the result and stop the cluster before the hard deadline.
    deadline = t_armed + cfg["side_timeout"] - 40
    try:
        while fitter.is_alive() and time.time() < deadline:
            if return_due and "node_added_ts" not in out and time.time() >= return_due[0]:
                out["node_added_ts"] = time.time()
                cluster.add_node(num_cpus=1, resources={RTFT_NODE_RESOURCE: 1})
                out["node_added_done_ts"] = time.time()
            fitter.join(timeout=0.05)
        stop.set()
        recs = read_progress(progress)
        ends = [r for r in recs if r["kind"] == "end"]
        last = [r for r in recs if r["kind"] == "step" and r["committed"] and r["step"] >= steps_total]
        out["last_step_done_ts"] = max((r["ts"] for r in last), default=None)
        out["replicas_ended"] = sorted(r["rank"] for r in ends)
        if fitter.is_alive():
            out["status"] = "hung" if last else "timeout"
            waited = time.time() - out["last_step_done_ts"] if last else None
            out["completion_reason"] = (
                f"fit() had not returned {waited:.0f} s after the last step ({steps_total}) was completed"
                if last
                else f"fit() had not returned after {time.time() - t0:.0f} s and step {steps_total} was never reached"
            )
        elif "raised" in fit_out:
            exc = fit_out["raised"]
            out["status"] = "error"
            out["error"] = f"{type(exc).__name__}: {str(exc)[:2000]}"
            out["completion_reason"] = f"fit() raised {out['error'][:300]}"
        elif fit_out.get("error") is not None:
            err = fit_out["error"]
            out["status"] = "failed"
            out["error"] = f"{type(err).__name__}: {str(err)[:2000]}"
            out["completion_reason"] = f"fit() returned an error: {out['error'][:300]}"
        else:
            out["status"] = "succeeded"
            out["completed"] = True
            out["completion_reason"] = "fit() returned without error"
            if out["last_step_done_ts"] is not None:
                out["fit_returned_after_last_step_s"] = fit_out["done_ts"] - out["last_step_done_ts"]
    except Exception as exc:
        out["status"] = "error"
        out["error"] = f"{type(exc).__name__}: {str(exc)[:2000]}"
        out["completion_reason"] = f"the benchmark's driver raised {out['error'][:300]}"
    # The lighthouse runs in Ray Train's actor: its quorum lines are in that worker's log.
    import glob

    logs = glob.glob(os.path.join(os.environ.get("TMPDIR", "/tmp"), "ray", "session_*", "logs", "worker-*"))
    out["lighthouse_quorums"] = sorted(
        (q for path in logs for q in lighthouse_quorums(path)), key=lambda q: q["created"]
    )
    recs = read_progress(progress)
    out.update(analyse_torchft(recs, out))
    out.update(replacement_facts(recs, out))
    # Written before the cluster stops: a hung controller may hold ray.shutdown up, and the
    # deadline then kills the process group with the figures already on disk.
    write_json(cfg["out"], out)
    stopper = threading.Thread(target=stop_cluster, args=(cluster,), daemon=True)
    stopper.start()
    stopper.join(timeout=25)
    os._exit(0)


def replacement_facts(recs: list[dict[str, Any]], out: dict[str, Any]) -> dict[str, Any]:
    """What became of Ray Train's replacement replica group (progress index NODES): when it
    started, and how many steps it committed alone (a replacement that starts after the
    survivors have finished forms a quorum of one and trains the whole job again by itself,
    and ``fit()`` waits for it)."""
    start = next((r for r in recs if r["kind"] == "start" and r["rank"] == NODES), None)
    if start is None:
        return {"replacement_started": False}
    mine = [r for r in recs if r["kind"] == "step" and r["rank"] == NODES and r["committed"]]
    survivors_end = [r["ts"] for r in recs if r["kind"] == "end" and r["rank"] != NODES]
    res: dict[str, Any] = {
        "replacement_started": True,
        "replacement_solo_steps": sum(1 for r in mine if r["participants"] == 1),
        "replacement_first_step": mine[0]["step"] if mine else None,
        "survivors_ended_before_replacement_started": bool(survivors_end) and max(survivors_end) < start["ts"],
    }
    if out.get("node_added_done_ts"):
        res["replacement_started_after_node_added_s"] = start["ts"] - out["node_added_done_ts"]
    return res


# --------------------------------------------------------------------------- driver


def side_timeout(side: str, args: argparse.Namespace) -> float:
    return {
        "ours": args.ours_timeout,
        "raytrain_tuned": args.raytrain_timeout,
        "raytrain_default": args.raytrain_timeout,
        "torchft": args.torchft_timeout,
        "raytrain_torchft": args.raytrain_timeout,
    }[side]


def run_side(side: str, rep: int, args: argparse.Namespace, spec_path: str, work: str) -> dict[str, Any]:
    side_dir = os.path.join(work, f"{side}-{rep}")
    os.makedirs(side_dir, exist_ok=True)
    out_path = os.path.join(side_dir, "result.json")
    cfg = {
        "side": side,
        "spec": spec_path,
        "work": side_dir,
        "out": out_path,
        "kill_step": args.kill_step,
        "kill_rank": args.kill_rank,
        "side_timeout": side_timeout(side, args),
        "return_delay_s": args.return_delay,
    }
    env = dict(os.environ)
    paths = [ROOT] + ([args.torchft_path] if side in ("torchft", "raytrain_torchft") and args.torchft_path else [])
    env["PYTHONPATH"] = os.pathsep.join(paths + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.pop("RAY_ADDRESS", None)
    env["RAY_TRAIN_V2_ENABLED"] = "1"
    # A private temp dir: Ray's session files and its ray_current_cluster live there, so no
    # other process on this machine joins the benchmark's cluster by accident.
    tmp = tempfile.mkdtemp(prefix="rb", dir="/tmp")
    env["TMPDIR"] = tmp
    for k in RAY_TUNED_ENV:
        env.pop(k, None)
    if side == "raytrain_tuned":
        env.update(RAY_TUNED_ENV)
        cfg["system_config"] = RAY_TUNED_SYSTEM_CONFIG
        cfg["checkpoint_every"] = 1
    elif side == "raytrain_default":
        cfg["checkpoint_every"] = 5
    with open(spec_path) as f:
        spec = json.load(f)
    # Ours and TorchFT go on long enough for the returning node to rejoin; the steps after the
    # recovery enter no recovery figure.
    steps = (
        args.rejoin_steps if side in ("ours", "torchft", "raytrain_torchft") and args.return_delay >= 0 else args.steps
    )
    spec["train"]["steps"] = steps
    cfg["spec"] = os.path.join(side_dir, "spec.json")
    cfg["steps"] = steps
    write_json(cfg["spec"], spec)
    cfg_path = os.path.join(side_dir, "cfg.json")
    write_json(cfg_path, cfg)
    cmd = [sys.executable, os.path.abspath(__file__), "--_child", cfg_path]
    limit = cfg["side_timeout"] + 30
    log_path = os.path.join(side_dir, "log.txt")
    t0 = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:  # the child's own deadline failed: kill its whole session
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = 124
    res: dict[str, Any] = {"side": side, "status": "crashed", "rc": rc}
    if os.path.exists(out_path):
        with open(out_path) as f:
            res = json.load(f)
    res["rc"], res["wall_s"], res["rep"] = rc, time.time() - t0, rep
    res["loadavg_1m_after"] = os.getloadavg()[0]
    if "recovery_s" not in res:
        with open(log_path) as f:
            res["log_tail"] = "".join(f.readlines()[-30:])
    if args.keep:  # Ray's session logs (the workers' own tracebacks) stay too
        res["ray_tmpdir"] = tmp
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    return res


def fmt(x: Any, spec: str = ".2f") -> str:
    return "n/a" if x is None else format(x, spec)


def stats(values: list[float]) -> dict[str, Any] | None:
    vals = [v for v in values if v is not None]
    if not vals:
        return None
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "n": len(vals)}


def fmt_stats(s: dict[str, Any] | None, unit: str = "s", spec: str = ".2f") -> str:
    if s is None:
        return "n/a"
    return f"{format(s['median'], spec)} {unit} (range {format(s['min'], spec)}-{format(s['max'], spec)}, n={s['n']})"


def versions(res: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    import ray
    import torch

    # torchft as the TorchFT runs imported it (it may come from --torchft-path, not this process).
    tft = next((r["torchft_version"] for r in res.get("torchft", []) if r.get("torchft_version")), None)
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "ray": ray.__version__,
        "torchft": tft or _dist_version("torchft"),
    }


def summarise(res: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    from elastic.control.timing import PHASES

    summary: dict[str, Any] = {}
    for side, runs in res.items():
        s: dict[str, Any] = {
            "recovery_s": stats([r.get("recovery_s") for r in runs]),
            "lost_steps": stats([r.get("lost_steps") for r in runs]),
            "statuses": [r.get("status") for r in runs],
        }
        keys = sorted({k for r in runs for k in (r.get("breakdown") or {})})
        s["breakdown"] = {k: stats([(r.get("breakdown") or {}).get(k) for r in runs]) for k in keys}
        if any("rejoin_s" in r for r in runs):
            s["rejoin_s"] = stats([r.get("rejoin_s") for r in runs])
            s["add_node_s"] = stats([r.get("add_node_s") for r in runs])
        if side == "ours":  # what the product itself reported in summary.json, on the driver's clock
            s["summary_json"] = {
                k: stats([(r.get("summary_recovery") or {}).get(k) for r in runs])
                for k in ("detect_s", "recover_s", "downtime_s", "lost_steps")
            }
            phases = [
                k for k in PHASES if any(k in ((r.get("summary_recovery") or {}).get("breakdown") or {}) for r in runs)
            ]
            s["phases"] = {
                k: stats([((r.get("summary_recovery") or {}).get("breakdown") or {}).get(k) for r in runs])
                for k in phases
            }
        if side == "raytrain_torchft":
            s["completed"] = [r.get("completed", False) for r in runs]
            s["completion_reasons"] = [r.get("completion_reason") for r in runs]
            s["replacement_solo_steps"] = [r.get("replacement_solo_steps") for r in runs]
            s["replacement_started_after_node_added_s"] = stats(
                [r.get("replacement_started_after_node_added_s") for r in runs]
            )
        if side in ("torchft", "raytrain_torchft") and all(r.get("status") == "skipped" for r in runs):
            s["skipped"] = runs[0].get("error")
        summary[side] = s
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description="Node-loss recovery: elastic runtime vs Ray Train V2 (tuned, default) and TorchFT."
    )
    ap.add_argument("--kill-step", type=int, default=12, help="kill the node when this step has completed (default 12)")
    ap.add_argument("--kill-rank", type=int, default=1, help="kill the node hosting this rank / replica (default 1)")
    ap.add_argument(
        "--steps",
        type=int,
        default=60,
        help="training steps of the Ray Train runs (and of ours/TorchFT with --return-delay -1) (default 60)",
    )
    ap.add_argument(
        "--rejoin-steps",
        type=int,
        default=150,
        help="training steps of ours and TorchFT, which also time a returning node (default 150)",
    )
    ap.add_argument("--reps", type=int, default=3, help="repetitions per side (default 3)")
    ap.add_argument("--sides", default=",".join(SIDES), help=f"comma-separated subset of {','.join(SIDES)}")
    ap.add_argument(
        "--return-delay",
        type=float,
        default=1.0,
        help="ours and torchft: add a node back this long after the first step at the smaller size (-1: never)",
    )
    ap.add_argument(
        "--torchft-path",
        default=os.environ.get("TORCHFT_PATH"),
        help="a directory to put on PYTHONPATH for the torchft side (pip install --target DIR torchft==0.2.0 ...)",
    )
    ap.add_argument("--ours-timeout", type=float, default=150.0)
    ap.add_argument("--raytrain-timeout", type=float, default=300.0)
    ap.add_argument("--torchft-timeout", type=float, default=150.0)
    ap.add_argument(
        "--results",
        default=DEFAULT_RESULTS,
        help=f"results JSON (default {os.path.relpath(DEFAULT_RESULTS, ROOT)}; '' to skip)",
    )
    ap.add_argument("--keep", action="store_true", help="keep the working directory (logs, events, progress)")
    ap.add_argument("--model", choices=sorted(MODELS), default=None, help="model size (default small)")
    ap.add_argument("--_child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.model is not None and MODELS[args.model] is not MODEL:  # re-run with the size fixed for the children
        env = dict(os.environ, BENCH_RECOVERY_MODEL=args.model)
        rest = [a for a in (argv if argv is not None else sys.argv[1:]) if a != args.model and a != "--model"]
        rest = [a for a in rest if not a.startswith("--model=")]
        return subprocess.call([sys.executable, os.path.abspath(__file__), *rest], env=env)

    if args._child:
        with open(args._child) as f:
            cfg = json.load(f)
        side = cfg["side"]
        if side == "ours":
            ours_child(cfg)
        elif side == "raytrain_torchft":
            raytrain_torchft_child(cfg)
        elif side.startswith("raytrain"):
            raytrain_child(cfg)
        else:
            torchft_child(cfg)
        return 0

    sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    bad = [s for s in sides if s not in SIDES]
    if bad:
        ap.error(f"--sides: unknown side(s) {bad}; choose from {', '.join(SIDES)}")
    if not 1 <= args.kill_step < args.steps:
        ap.error("--kill-step must be between 1 and --steps - 1")
    if not 0 <= args.kill_rank < NODES:
        ap.error(f"--kill-rank must be in 0..{NODES - 1}")
    if args.reps < 1:
        ap.error("--reps must be >= 1")

    from elastic.ingest.corpus import synthetic_corpus

    work = tempfile.mkdtemp(prefix="bench-recovery-")
    started = datetime.datetime.now(datetime.timezone.utc)
    try:
        m = MODEL
        state_mb = 12 * _param_count(m) / 1e6  # fp32 weights + two AdamW moments
        corpus = synthetic_corpus(os.path.join(work, "data"), 4000, m["seq_len"], m["vocab_size"], 0)
        spec = spec_dict(args.steps, "file://" + os.path.abspath(corpus))
        spec_path = os.path.join(work, "spec.json")
        write_json(spec_path, spec)
        print(
            f"{NODES}-node local cluster (head num_cpus=0, {NODES} x num_cpus=1), GPT {m} ({state_mb:.1f} MB of "
            f"weights + AdamW state), global_batch {GLOBAL_BATCH}, {args.steps} steps "
            f"(ours and TorchFT: {args.rejoin_steps}, to "
            "time a "
            f"returning node {args.return_delay:g} s after the first step at the smaller size); "
            f"the node of rank {args.kill_rank} is killed "
            f"(SIGKILL of its raylet's children + remove_node) when step {args.kill_step} completes; {args.reps} "
            f"repetition(s) per side; load average now {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs",
            flush=True,
        )
        res: dict[str, list[dict[str, Any]]] = {s: [] for s in sides}
        for rep in range(args.reps):  # interleaved, so drifting load hits every side alike
            for side in sides:
                if side in ("torchft", "raytrain_torchft") and res[side] and res[side][0].get("status") == "skipped":
                    res[side].append(dict(res[side][0], rep=rep))
                    continue
                print(f"[rep {rep + 1}/{args.reps}] {side} ...", flush=True)
                r = run_side(side, rep, args, spec_path, work)
                res[side].append(r)
                print(
                    f"  {side}: status {r.get('status')}, recovery {fmt(r.get('recovery_s'))} s, lost steps "
                    f"{fmt(r.get('lost_steps'), 'd')}, breakdown {_fmt_bd(r.get('breakdown'))}, wall "
                    f"{r['wall_s']:.0f} s, "
                    f"load {r['loadavg_1m_after']:.2f}"
                    + (
                        f", completed {r.get('completed', False)} ({r.get('completion_reason')})"
                        if side == "raytrain_torchft"
                        else ""
                    ),
                    flush=True,
                )
                if "recovery_s" not in r:
                    print(
                        f"  {side}: no step at a smaller size was measured; "
                        f"{r.get('error', '')}\n{r.get('log_tail', '')}",
                        flush=True,
                    )

        summary = summarise(res)
        print(
            "\nrecovery = from the SIGKILL to the first step completed by every rank at the smaller size; lost steps = "
            "the last step any worker completed minus the step training resumed from"
        )
        for side in sides:
            s = summary[side]
            if s.get("skipped"):
                print(f"{side:17s} skipped: {s['skipped']}")
                continue
            print(
                f"{side:17s} recovery {fmt_stats(s['recovery_s'])}; lost steps "
                f"{fmt_stats(s['lost_steps'], 'step(s)', '.0f')}"
                + (
                    f"; node added back -> first step at full size {fmt_stats(s['rejoin_s'])}"
                    if s.get("rejoin_s")
                    else ""
                )
            )
            if "completed" in s:
                done = sum(1 for c in s["completed"] if c)
                print(f"{'':19s}job completed in {done} of {len(s['completed'])} run(s)")
                for reason in s["completion_reasons"]:
                    print(f"{'':21s}{reason}")
                late = fmt_stats(s["replacement_started_after_node_added_s"])
                print(
                    f"{'':19s}replacement replica group: started {late}"
                    f" after the node was back; steps it trained alone (quorum of 1) per run: "
                    f"{s['replacement_solo_steps']}"
                )
            for k, v in s["breakdown"].items():
                print(f"{'':19s}{k:34s} {fmt_stats(v)}")
            if s.get("summary_json"):
                print(
                    f"{'':19s}summary.json (driver clock): "
                    + ", ".join(
                        f"{k} {fmt_stats(v, 'step(s)', '.0f') if k == 'lost_steps' else fmt_stats(v)}"
                        for k, v in s["summary_json"].items()
                    )
                )
            if s.get("phases"):
                print(f"{'':19s}where our downtime went (summary.json recoveries[0].breakdown, driver clock):")
                for k, v in s["phases"].items():
                    print(f"{'':21s}{k:32s} {fmt_stats(v)}")
        ratios = {}
        o = summary.get("ours", {}).get("recovery_s")
        for base in ("raytrain_tuned", "raytrain_default", "torchft", "raytrain_torchft"):
            b = summary.get(base, {}).get("recovery_s")
            if o and b:
                ratios[f"ours/{base}"] = o["median"] / b["median"]
        print()
        for k, v in ratios.items():
            head = "  <- headline" if k == "ours/raytrain_tuned" else ""
            print(f"ratio {k} = {v:.3f} (medians){head}")

        if args.results:
            slim = {
                s: [{k: v for k, v in r.items() if k not in ("log_tail",)} for r in runs] for s, runs in res.items()
            }
            os.makedirs(os.path.dirname(os.path.abspath(args.results)), exist_ok=True)
            write_json(
                args.results,
                {
                    "benchmark": "benchmarks/recovery_vs_raytrain.py",
                    "date_utc": started.strftime("%Y-%m-%dT%H:%M:%SZ"),
                    "finished_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                    "host": {
                        "hostname": platform.node(),
                        "cpus": os.cpu_count(),
                        "platform": platform.platform(),
                        "loadavg_at_start_note": "other processes shared the CPUs; see loadavg_1m_after per run",
                    },
                    "versions": versions(res),
                    "scenario": {
                        "nodes": NODES,
                        "model": MODEL,
                        "state_mb": round(state_mb, 1),
                        "global_batch": GLOBAL_BATCH,
                        "steps": args.steps,
                        "steps_ours_torchft": args.rejoin_steps if args.return_delay >= 0 else args.steps,
                        "kill_step": args.kill_step,
                        "kill_rank": args.kill_rank,
                        "reps": args.reps,
                        "return_delay_s": args.return_delay,
                        "raytrain_tuned": {
                            "env": RAY_TUNED_ENV,
                            "system_config": RAY_TUNED_SYSTEM_CONFIG,
                            "checkpoint_every": 1,
                        },
                        "raytrain_default": {"checkpoint_every": 5},
                        "raytrain_torchft": {
                            "torch_config": "TorchftConfig(backend='gloo')",
                            "replica_groups": NODES,
                            "workers_per_replica_group": 1,
                            "lighthouse_min_replicas": 1,
                            "lighthouse_heartbeat_timeout_ms": TORCHFT_HEARTBEAT_TIMEOUT_MS,
                            "lighthouse_join_timeout_ms": TORCHFT_JOIN_TIMEOUT_MS,
                            "max_failures": 3,
                            "rows_per_replica": GLOBAL_BATCH // NODES,
                        },
                        "torchft": {
                            "lighthouse_heartbeat_timeout_ms": TORCHFT_HEARTBEAT_TIMEOUT_MS,
                            "lighthouse_join_timeout_ms": TORCHFT_JOIN_TIMEOUT_MS,
                            "rows_per_replica": GLOBAL_BATCH // NODES,
                        },
                    },
                    "definitions": {
                        "recovery_s": "kill_ts (stamped by the benchmark just before SIGKILL) -> the first step "
                        "completed "
                        "by every rank at the smaller size, from the workers' own per-step timestamps",
                        "lost_steps": "the last step any worker completed before the recovery minus the step "
                        "training resumed from",
                    },
                    "summary": summary,
                    "ratios": ratios,
                    "runs": slim,
                },
            )
            print(f"results written to {os.path.relpath(os.path.abspath(args.results), ROOT)}")
        return 0
    finally:
        if args.keep:
            print(f"working directory kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


def _fmt_bd(bd: dict[str, float] | None) -> str:
    if not bd:
        return "n/a"
    return ", ".join(f"{k} {v:.2f}" for k, v in bd.items())


if __name__ == "__main__":
    sys.exit(main())
