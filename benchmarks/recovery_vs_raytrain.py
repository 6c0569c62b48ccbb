"""Recovery from a lost node: the elastic runtime against Ray Train V2, side by side.

The same failure scenario both ways, each on a fresh ``ray.cluster_utils.Cluster``: a head
with ``num_cpus=0`` and 4 worker nodes with ``num_cpus=1``, one training worker per node, a
tiny GPT on gloo, the same corpus rows in the same order (``BatchLayout``), the same
optimizer (``build_optimizer``) and global batch (12 with micro-batch 1, so every DP from
1 to 4 keeps it exact). When step ``k`` (default 12) completes, the node that hosts rank 1
is killed with the project's ``kill_node`` helper: SIGKILL of the worker processes on that
node, then ``Cluster.remove_node`` (DESIGN.md section 7).

(a) Ours: ``ElasticTrainer`` with ``elastic.min_dp=1, max_dp=4``, memory snapshots every
    step, storage checkpoints every 5 steps, and a ``FaultInjector`` ``kill_node`` fault.
    Figures from ``events.jsonl``: from the kill (the fault's ``fired_at``) to the first
    ``step`` event at the new DP; lost steps from ``summary.json`` (``recoveries[0]``),
    checked against the steps redone that the events show.
(b) Ray Train V2: ``TorchTrainer`` with ``ScalingConfig(num_workers=(1, 4))`` (elastic),
    ``FailureConfig(max_failures=3)``, a checkpoint every 5 steps through
    ``ray.train.report`` to a local ``storage_path``; Ray Train's own timeouts are left at
    their defaults. Every worker appends a line per step (wall-clock time, step, world
    size) to a local progress file; a driver thread watches it and kills the node at the
    same step. Figures: kill to the first step completed (by every rank) at the smaller
    world size, and steps redone (last step reached before the kill minus the step the new
    worker group resumed from).

Each side runs in its own child process with a hard time limit, so nothing can hang: a
side that has not recovered in time is reported as such, with the time it was given.
The printed figures are measured side by side in one run, not absolute claims::

    ratio ours/raytrain = X.XXX (goal <= 0.1)

Usage::

    .venv/bin/python benchmarks/recovery_vs_raytrain.py [--kill-step 12] [--steps 30] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

NODES = 4
GLOBAL_BATCH = 12  # divisible by every DP degree from 1 to 4 with micro-batch 1
MICRO_BATCH = 1
TINY_MODEL = {"n_layers": 2, "d_model": 64, "n_heads": 4, "vocab_size": 256, "seq_len": 32}


# --------------------------------------------------------------------------- shared


def spec_dict(args: argparse.Namespace, corpus_uri: str) -> dict[str, Any]:
    """The job both sides train (Ray Train reads the model/optimizer/data fields)."""
    return {
        "name": "recovery-bench",
        "seed": 0,
        "model": dict(TINY_MODEL),
        "data": {"source": corpus_uri},
        "parallel": {"micro_batch": MICRO_BATCH},
        "elastic": {"min_dp": 1, "max_dp": NODES},
        "resources": {"cpus_per_worker": 1},
        "train": {"steps": args.steps, "global_batch": GLOBAL_BATCH, "lr": 3.0e-3},
        "checkpoint": {"every_steps": args.checkpoint_every, "memory_every_steps": 1},
    }


def start_cluster():
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    for _ in range(NODES):
        cluster.add_node(num_cpus=1)
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
    from elastic.testing.faults import worker_nodes

    ids = [n.node_id for n in worker_nodes(cluster)]
    return ids.index(node_id)


def write_json(path: str, obj: dict[str, Any]) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, indent=2)
    os.replace(path + ".tmp", path)


def arm_deadline(seconds: float, out_path: str, partial: dict[str, Any]) -> None:
    """In a child: after ``seconds``, write what was measured so far and kill the whole
    process group (this child and its Ray cluster). Nothing outlives the budget."""

    def fire() -> None:
        partial.setdefault("status", "timeout")
        partial["timed_out_after_s"] = seconds
        try:
            write_json(out_path, partial)
        finally:
            os.killpg(os.getpgid(0), signal.SIGKILL)

    t = threading.Timer(seconds, fire)
    t.daemon = True
    t.start()


# --------------------------------------------------------------------------- (a) ours


class KillNodeOfRank:
    """Controller callback: when step ``k`` completes, kill the node that hosts ``rank``.

    Resolves the node at that moment, then hands over to the project's ``FaultInjector``
    (which stamps ``fired_at`` and calls ``kill_node``)."""

    def __init__(self, cluster, at_step: int, rank: int):
        from elastic.testing.faults import Fault, FaultInjector

        self.cluster, self.rank = cluster, rank
        self.fault = Fault("kill_node", at_step=at_step, node_index=0)
        self.injector = FaultInjector([self.fault], cluster=cluster)
        self.killed_node_id: str | None = None
        self.step_at_kill: int | None = None
        self.kill_done_ts: float | None = None

    def on_step(self, step: int, group: Any) -> None:
        if self.fault.fired_at is None and step >= self.fault.at_step:
            node_id = next(m.node_id for m in group.members if m.rank == self.rank)
            self.fault.node_index = node_index_of(self.cluster, node_id)
            self.killed_node_id, self.step_at_kill = node_id, step
            self.injector.on_step(step, group)
            self.kill_done_ts = time.time()  # kill_node runs on the controller's thread
            return
        self.injector.on_step(step, group)

    def close(self) -> None:
        self.injector.close()


def ours_child(args: argparse.Namespace) -> None:
    from elastic import ElasticTrainer
    from elastic.events import read_events
    from jobs import JobSpec

    out: dict[str, Any] = {"side": "ours"}
    arm_deadline(args.side_timeout, args.out, out)
    with open(args.spec) as f:
        spec = JobSpec.from_dict(json.load(f))
    run_dir = os.path.join(args.work, "run")
    t0 = time.time()
    cluster = start_cluster()
    out["cluster_start_s"] = time.time() - t0
    cb = KillNodeOfRank(cluster, args.kill_step, args.kill_rank)
    error = None
    try:
        result = ElasticTrainer(spec, run_dir=run_dir, callbacks=[cb], progress=False).fit()
        out["status"] = result.status
        out["summary"] = result.model_dump()
    except Exception as exc:  # report, do not hide: the figures below say what happened
        error = f"{type(exc).__name__}: {exc}"
        out["status"] = "error"
        out["error"] = error
    finally:
        stop_cluster(cluster)

    kill_ts = cb.fault.fired_at
    out["kill_ts"], out["step_at_kill"], out["kill_done_ts"] = kill_ts, cb.step_at_kill, cb.kill_done_ts
    events = read_events(run_dir) if os.path.exists(os.path.join(run_dir, "events.jsonl")) else []
    out["events"] = events
    steps = [e for e in events if e["kind"] == "step"]
    resizes = [e for e in events if e["kind"] == "resize"]
    restores = [e for e in events if e["kind"] == "restore"]
    failures = [e for e in events if e["kind"] == "failure"]
    out["old_dp"] = steps[0]["dp"] if steps else None
    if kill_ts is not None and resizes:
        new_dp = resizes[0]["new_dp"]
        after = [e for e in steps if e["ts"] > kill_ts and e["dp"] == new_dp]
        out["new_dp"] = new_dp
        if after:
            out["recovery_s"] = after[0]["ts"] - kill_ts
            out["first_step_at_new_dp"] = after[0]["step"]
        if failures:
            out["detect_s"] = failures[0]["ts"] - kill_ts
        if restores:
            r = restores[0]
            before = [e["step"] for e in steps if e["ts"] <= r["ts"]]
            out["restored_step"] = r["step"]
            out["restore_source"] = r["source"]
            out["last_step_before_restore"] = max(before) if before else 0
            out["steps_redone_events"] = max(0, out["last_step_before_restore"] - r["step"])
    recs = out.get("summary", {}).get("recoveries") or []
    if recs:
        out["lost_steps"] = recs[0]["lost_steps"]
        if "restored_step" in out:
            out["worker_step_at_failure"] = out["restored_step"] + recs[0]["lost_steps"]
        out["summary_recover_s"] = recs[0]["recover_s"]
    write_json(args.out, out)
    os._exit(0)


# --------------------------------------------------------------------------- (b) Ray Train


def raytrain_loop(config: dict[str, Any]) -> None:
    """The Ray Train training function: the same model, optimizer, data order and batch."""
    import contextlib

    import ray
    import ray.train
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from elastic.data import BatchLayout, ParquetCorpus
    from elastic.model import build_model, lm_loss
    from elastic.optim import build_optimizer
    from jobs import JobSpec

    torch.set_num_threads(1)  # as our workers: max(1, int(cpus_per_worker))
    spec = JobSpec.from_dict(config["spec"])
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    progress = config["progress"]

    def log(**rec: Any) -> None:
        line = json.dumps({"ts": time.time(), "rank": rank, "world_size": world, **rec}) + "\n"
        fd = os.open(progress, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)

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
    log(kind="start", resume_step=start, pid=os.getpid(), node_id=ray.get_runtime_context().get_node_id())

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
                    torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                                "scheduler": scheduler.state_dict(), "step": step}, os.path.join(tmp, "state.pt"))
                    checkpoint = ray.train.Checkpoint.from_directory(tmp)
                ray.train.report({"step": step}, checkpoint=checkpoint)
                log(kind="checkpoint", step=step)


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


class ProgressGroup:
    """The two ``WorkerGroup`` queries ``kill_node`` uses, answered from the progress file."""

    def __init__(self, path: str):
        self.path = path

    def _latest_starts(self) -> dict[int, dict[str, Any]]:
        starts: dict[int, dict[str, Any]] = {}
        for r in read_progress(self.path):
            if r["kind"] == "start":
                starts[r["rank"]] = r
        return starts

    def node_of(self, rank: int) -> str:
        return self._latest_starts()[rank]["node_id"]

    def pids_on_node(self, node_id: str) -> list[int]:
        return [r["pid"] for r in read_progress(self.path) if r["kind"] == "start" and r["node_id"] == node_id]


def raytrain_child(args: argparse.Namespace) -> None:
    os.environ["RAY_TRAIN_V2_ENABLED"] = "1"  # the default in Ray 2.60; explicit here
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from elastic.testing.faults import kill_node

    out: dict[str, Any] = {"side": "raytrain"}
    arm_deadline(args.side_timeout, args.out, out)
    with open(args.spec) as f:
        spec = json.load(f)
    progress = os.path.join(args.work, "progress.jsonl")
    t0 = time.time()
    cluster = start_cluster()
    out["cluster_start_s"] = time.time() - t0
    group = ProgressGroup(progress)
    stop = threading.Event()

    def watch() -> None:
        """Driver-side thread: kill rank's node when step k has completed."""
        while not stop.is_set():
            recs = read_progress(progress)
            done = [r["step"] for r in recs if r["kind"] == "step"]
            if done and max(done) >= args.kill_step:
                out["kill_ts"] = time.time()
                out["step_at_kill"] = max(done)
                node_id = group.node_of(args.kill_rank)
                out["killed_node_id"] = node_id
                kill_node(cluster, node_index_of(cluster, node_id), group)
                out["kill_done_ts"] = time.time()
                out["partial_progress"] = "node killed; waiting for Ray Train to resume at a smaller size"
                return
            time.sleep(0.005)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    trainer = TorchTrainer(
        raytrain_loop,
        train_loop_config={"spec": spec, "progress": progress, "checkpoint_every": args.checkpoint_every},
        scaling_config=ScalingConfig(num_workers=(1, NODES), use_gpu=False),
        run_config=RunConfig(name="recovery-bench", storage_path=os.path.join(args.work, "storage"),
                             failure_config=FailureConfig(max_failures=3)),
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
    out.update(analyse_progress(read_progress(progress), out.get("kill_ts")))
    write_json(args.out, out)
    os._exit(0)


def analyse_progress(recs: list[dict[str, Any]], kill_ts: float | None) -> dict[str, Any]:
    out: dict[str, Any] = {"progress": recs}
    if not recs:
        return out
    out["old_world_size"] = recs[0]["world_size"]
    if kill_ts is None:
        return out
    before = [r for r in recs if r["kind"] == "step" and r["ts"] <= kill_ts]
    out["last_step_before_kill"] = max((r["step"] for r in before), default=0)
    starts = [r for r in recs if r["kind"] == "start" and r["ts"] > kill_ts]
    out["restarts"] = sorted({(r["world_size"], r["resume_step"]) for r in starts})
    smaller = [r for r in recs if r["kind"] == "step" and r["ts"] > kill_ts and r["world_size"] < out["old_world_size"]]
    if not smaller:
        return out
    ws = smaller[0]["world_size"]
    first_step = min(r["step"] for r in smaller if r["world_size"] == ws)
    done = [r["ts"] for r in smaller if r["world_size"] == ws and r["step"] == first_step]
    if len(done) == ws:  # completed by every rank of the new group
        out["new_world_size"] = ws
        out["first_step_at_new_size"] = first_step
        out["recovery_s"] = max(done) - kill_ts
        resumed = [r for r in starts if r["world_size"] == ws]
        resume_step = resumed[0]["resume_step"] if resumed else first_step - 1
        out["resume_step"] = resume_step
        out["restart_s"] = min(r["ts"] for r in resumed) - kill_ts if resumed else None
        # Steps redone: every step the old group had reached beyond the one restored.
        reached = max(r["step"] for r in recs if r["kind"] == "step" and r["world_size"] == out["old_world_size"])
        out["last_step_reached"] = reached
        out["steps_redone"] = max(0, reached - resume_step)
    return out


# --------------------------------------------------------------------------- driver


def run_side(side: str, args: argparse.Namespace, spec_path: str, work: str) -> dict[str, Any]:
    side_dir = os.path.join(work, side)
    os.makedirs(side_dir, exist_ok=True)
    out_path = os.path.join(side_dir, "result.json")
    cmd = [sys.executable, os.path.abspath(__file__), "--_child", side, "--_spec", spec_path, "--_work", side_dir,
           "--_out", out_path, "--kill-step", str(args.kill_step), "--kill-rank", str(args.kill_rank),
           "--steps", str(args.steps), "--checkpoint-every", str(args.checkpoint_every),
           "--_side-timeout", str(args.ours_timeout if side == "ours" else args.raytrain_timeout)]
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.pop("RAY_ADDRESS", None)
    env["RAY_TRAIN_V2_ENABLED"] = "1"
    limit = (args.ours_timeout if side == "ours" else args.raytrain_timeout) + 30
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
    res["rc"], res["wall_s"] = rc, time.time() - t0
    if "recovery_s" not in res:
        with open(log_path) as f:
            res["log_tail"] = "".join(f.readlines()[-30:])
    return res


def fmt(x: Any, spec: str = ".2f") -> str:
    return "n/a" if x is None else format(x, spec)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Node-loss recovery: elastic runtime vs Ray Train V2, side by side.")
    ap.add_argument("--kill-step", type=int, default=12, help="kill the node when this step has completed (default 12)")
    ap.add_argument("--kill-rank", type=int, default=1, help="kill the node hosting this rank (default 1)")
    ap.add_argument("--steps", type=int, default=30, help="training steps (default 30)")
    ap.add_argument("--checkpoint-every", type=int, default=5, help="storage checkpoint period, both sides (default 5)")
    ap.add_argument("--side", choices=("both", "ours", "raytrain"), default="both")
    ap.add_argument("--ours-timeout", type=float, default=100.0, help="time limit of our side in seconds (default 100)")
    ap.add_argument("--raytrain-timeout", type=float, default=230.0, help="time limit of Ray Train's side in seconds (default 230)")
    ap.add_argument("--json", metavar="OUT", help="write the figures as JSON to OUT")
    ap.add_argument("--keep", action="store_true", help="keep the working directory (logs, events, progress)")
    ap.add_argument("--_child", choices=("ours", "raytrain"), help=argparse.SUPPRESS)
    ap.add_argument("--_spec", help=argparse.SUPPRESS)
    ap.add_argument("--_work", help=argparse.SUPPRESS)
    ap.add_argument("--_out", help=argparse.SUPPRESS)
    ap.add_argument("--_side-timeout", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if not 1 <= args.kill_step < args.steps:
        ap.error("--kill-step must be between 1 and --steps - 1")
    if not 0 <= args.kill_rank < NODES:
        ap.error(f"--kill-rank must be in 0..{NODES - 1}")

    if args._child:
        args.spec, args.work, args.out, args.side_timeout = args._spec, args._work, args._out, args._side_timeout
        (ours_child if args._child == "ours" else raytrain_child)(args)
        return 0

    from elastic.data import synthetic_corpus

    work = tempfile.mkdtemp(prefix="bench-recovery-")
    try:
        m = TINY_MODEL
        corpus = synthetic_corpus(os.path.join(work, "data"), 4000, m["seq_len"], m["vocab_size"], 0)
        spec = spec_dict(args, "file://" + os.path.abspath(corpus))
        spec_path = os.path.join(work, "spec.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        print(f"{NODES}-node local cluster (head num_cpus=0, {NODES} x num_cpus=1), tiny GPT {m}, global_batch "
              f"{GLOBAL_BATCH}, micro_batch {MICRO_BATCH}, {args.steps} steps; node of rank {args.kill_rank} killed "
              f"(SIGKILL + remove_node) when step {args.kill_step} completes; storage checkpoint every "
              f"{args.checkpoint_every} steps", flush=True)
        sides = ["ours", "raytrain"] if args.side == "both" else [args.side]
        res: dict[str, dict[str, Any]] = {}
        for side in sides:
            print(f"running {side} ...", flush=True)
            res[side] = run_side(side, args, spec_path, work)
            r = res[side]
            print(f"  {side}: status {r.get('status')}, recovery {fmt(r.get('recovery_s'))} s, wall {r['wall_s']:.0f} s", flush=True)
            if "recovery_s" not in r:
                print(f"  {side}: no step at a smaller size was measured; {r.get('error', '')}\n{r.get('log_tail', '')}", flush=True)

        print()
        o, t = res.get("ours", {}), res.get("raytrain", {})
        if o:
            if o.get("kill_done_ts") and o.get("kill_ts"):
                o["kill_node_s"] = o["kill_done_ts"] - o["kill_ts"]
            print(f"ours:     kill at step {fmt(o.get('step_at_kill'), 'd')} (committed; workers had reached step "
                  f"{fmt(o.get('worker_step_at_failure'), 'd')}; kill_node took {fmt(o.get('kill_node_s'), '.2f')} s on the "
                  f"controller thread) -> dp {fmt(o.get('old_dp'), 'd')}->{fmt(o.get('new_dp'), 'd')}; "
                  f"failure detected {fmt(o.get('detect_s'), '.3f')} s after the kill; first step at the new DP (step "
                  f"{fmt(o.get('first_step_at_new_dp'), 'd')}) {fmt(o.get('recovery_s'), '.3f')} s after the kill; restored "
                  f"step {fmt(o.get('restored_step'), 'd')} from {o.get('restore_source', 'n/a')}; lost steps "
                  f"{fmt(o.get('lost_steps'), 'd')} (summary.json), steps redone per events {fmt(o.get('steps_redone_events'), 'd')}")
        if t:
            if t.get("kill_done_ts") and t.get("kill_ts"):
                t["kill_node_s"] = t["kill_done_ts"] - t["kill_ts"]
            print(f"raytrain: kill at step {fmt(t.get('step_at_kill'), 'd')} (kill_node took {fmt(t.get('kill_node_s'), '.2f')} s "
                  f"on a driver thread) -> world {fmt(t.get('old_world_size'), 'd')}->"
                  f"{fmt(t.get('new_world_size'), 'd')}; worker group restarted {fmt(t.get('restart_s'), '.1f')} s after the kill "
                  f"(restarts (world, resume step): {t.get('restarts', 'n/a')}); first step at the new size (step "
                  f"{fmt(t.get('first_step_at_new_size'), 'd')}) {fmt(t.get('recovery_s'), '.1f')} s after the kill; resumed from "
                  f"step {fmt(t.get('resume_step'), 'd')}, last step reached {fmt(t.get('last_step_reached'), 'd')}; steps redone "
                  f"{fmt(t.get('steps_redone'), 'd')}")
        ratio = None
        if o.get("recovery_s") is not None and t.get("recovery_s") is not None:
            ratio = o["recovery_s"] / t["recovery_s"]
            print(f"ratio ours/raytrain = {ratio:.3f} (goal <= 0.1)")
        elif o.get("recovery_s") is not None and t:
            bound = o["recovery_s"] / (t.get("timed_out_after_s") or t["wall_s"])
            print(f"ratio ours/raytrain < {bound:.3f} (goal <= 0.1): Ray Train did not reach a step at a smaller size within "
                  f"its {fmt(t.get('timed_out_after_s') or t['wall_s'], '.0f')} s limit")
        else:
            print("ratio ours/raytrain = n/a (a side did not produce a recovery figure; see above)")
        lost_o = o.get("lost_steps")
        print(f"lost steps: ours {fmt(lost_o, 'd')} (goal <= 1), raytrain {fmt(t.get('steps_redone'), 'd')}")

        if args.json:
            slim = {s: {k: v for k, v in r.items() if k not in ("events", "progress", "log_tail")} for s, r in res.items()}
            write_json(args.json, {"kill_step": args.kill_step, "kill_rank": args.kill_rank, "steps": args.steps,
                                   "checkpoint_every": args.checkpoint_every, "sides": slim, "ratio": ratio, "goal_ratio": 0.1,
                                   "lost_steps_ours": lost_o, "steps_redone_raytrain": t.get("steps_redone"), "goal_lost_steps_ours": 1})
        return 0
    finally:
        if args.keep:
            print(f"working directory kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
