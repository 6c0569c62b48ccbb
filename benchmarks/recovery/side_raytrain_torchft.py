"""Side ``raytrain_torchft``: Ray Train V2 ``TorchTrainer`` with ``TorchftConfig`` (the
Ray-native in-place fault tolerance): ``num_workers=4``, each worker its own replica group
(Ray Train's replica groups are of one worker), one per node; the lighthouse is Ray Train's
actor on the head node, with ``min_replicas=1``, the same 1 s heartbeat timeout and 10 s join
timeout as ``torchft``; the training function builds the ``Manager`` (lighthouse from
``TORCHFT_LIGHTHOUSE``, the replica group's store from ``MASTER_ADDR/PORT``, both set by Ray
Train) and trains exactly as ``torchft`` does (3 rows per replica per step, one
``Manager.allreduce`` of the gradients, ``should_commit``). Ray Train replaces the lost
replica group in the dead worker's placement-group slot.

This side's head has 1 CPU (Ray Train pins the lighthouse actor, which needs 1 CPU to be
scheduled, to the head with a hard node affinity: with ``num_cpus=0`` there, ``fit()`` fails
at start with ControllerError "The actor is not schedulable"), and its workers ask for a
custom resource that only the 4 worker nodes carry; the node is added back after the first
step without it (as for ``torchft``), so the replacement can be placed and heal from a live
peer (measured: it starts ~16 s after the node is back; when the survivors have finished by
then, it forms a quorum of one and trains the whole job again alone, and ``fit()`` waits for
it: ``replacement_solo_steps``). ``fit()`` runs in a thread: a run whose ``fit()`` has not
returned by the time limit is reported ``completed: false`` with the reason (the project saw
the job hang after the last step, and a ``ControllerError`` "actor ... is unavailable"), not
as a crash.

``raytrain_torchft_loop`` runs in Ray Train's workers; the rest in the side's child process.
"""

from __future__ import annotations

import glob
import os
import threading
import time
from typing import Any

from benchmarks.harness.cluster import start_cluster
from benchmarks.harness.kill import add_node_now
from benchmarks.harness.proc import arm_deadline
from benchmarks.harness.results import write_json
from benchmarks.recovery import torchft_loop as ft
from benchmarks.recovery.progress import append_line, read_progress, report_skipped, side_inputs
from benchmarks.recovery.scenario import (
    NODES,
    RTFT_NODE_RESOURCE,
    TORCHFT_HEARTBEAT_TIMEOUT_MS,
    TORCHFT_JOIN_TIMEOUT_MS,
)


def raytrain_torchft_loop(config: dict[str, Any]) -> None:
    """The Ray Train V2 training function under ``TorchftConfig``: each worker is its own
    replica group (Ray Train's replica groups are of one worker); the same torchft training
    step as ``side_torchft.torchft_replica`` (one Manager allreduce of the flattened
    gradients, ``should_commit`` before the optimizer step, 3 rows per replica per step)."""
    import ray
    import ray.train
    import torch
    from torchft import Manager

    from elastic.ingest.corpus import ParquetCorpus

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
    replica = ft.Replica.build(config["spec"])
    # The lighthouse address comes from TORCHFT_LIGHTHOUSE (set by Ray Train's torchft
    # backend), the replica group's store from MASTER_ADDR/MASTER_PORT (its own
    # one-worker process group): torchft's defaults, as Ray's example uses them.
    manager = Manager(**replica.manager_kwargs(), replica_id=f"replica_{idx}_{os.getpid()}")
    corpus = ParquetCorpus(replica.spec.data.source)
    ft.torchft_steps(manager, replica, corpus, world_rank, progress, log, not replacement)
    log(kind="end", step=manager.current_step())


def _trainer(spec: dict[str, Any], progress: str, work: str):
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer
    from ray.train.v2.torch.torchft_config import TorchftConfig

    return TorchTrainer(
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
            storage_path=os.path.join(work, "storage"),
            failure_config=FailureConfig(max_failures=3),
        ),
    )


def raytrain_torchft_child(cfg: dict[str, Any]) -> None:
    """4 replica groups of 1 worker, the lighthouse (an actor on the head node, started by
    Ray Train) with min_replicas 1 and a 1 s heartbeat timeout. ``fit()`` runs in a thread so
    that the main thread can add a node back (Ray starts nodes from the main thread only) and
    can tell a job that completes from one that hangs: ``completed`` is false, with the
    reason, when ``fit()`` has not returned by the side's time limit."""
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
        import torchft  # noqa: F401
        from ray.train.torch import TorchTrainer  # noqa: F401
        from ray.train.v2.torch.torchft_config import TorchftConfig  # noqa: F401
    except Exception as exc:
        out["completion_reason"] = "skipped"
        report_skipped(cfg, out, "torchft / TorchftConfig", exc)

    out["torchft_version"] = ft.torchft_version()
    spec, progress = side_inputs(cfg)
    t0 = time.time()
    # Ray Train pins its lighthouse actor (default resources: 1 CPU to be scheduled) to the
    # controller's node with a hard NodeAffinity; the controller runs on the driver's node,
    # the head, and a head with num_cpus=0 (as the other sides use) makes the lighthouse
    # infeasible: fit() fails at start with ControllerError "The actor is not schedulable"
    # (measured here). So this side's head has 1 CPU, and the workers ask for a resource only
    # the 4 worker nodes carry, so that none is placed on the head.
    started = start_cluster(NODES, head_cpus=1, node_resources={RTFT_NODE_RESOURCE: 1})
    out["cluster_start_s"] = time.time() - t0
    stop = threading.Event()
    return_due: list[float] = []
    trainer = _trainer(spec, progress, cfg["work"])
    fit_out: dict[str, Any] = {}

    def fit() -> None:
        try:
            result = trainer.fit()
            fit_out["error"] = result.error
        except BaseException as exc:  # ControllerError and the like: report, do not crash
            fit_out["raised"] = exc
        fit_out["done_ts"] = time.time()

    ft.start_kill_watch(out, started.cluster, progress, cfg, stop, return_due)
    fitter = threading.Thread(target=fit, daemon=True)
    fitter.start()
    # Leave time to write the result and stop the cluster before the hard deadline.
    deadline = t_armed + cfg["side_timeout"] - 40
    try:
        while fitter.is_alive() and time.time() < deadline:
            if return_due and "node_added_ts" not in out and time.time() >= return_due[0]:
                add_node_now(out, started.cluster, num_cpus=1, resources={RTFT_NODE_RESOURCE: 1})
            fitter.join(timeout=0.05)
        stop.set()
        out.update(_completion(read_progress(progress), fitter.is_alive(), fit_out, spec["train"]["steps"], t0))
    except Exception as exc:
        out["status"] = "error"
        out["error"] = f"{type(exc).__name__}: {str(exc)[:2000]}"
        out["completion_reason"] = f"the benchmark's driver raised {out['error'][:300]}"
    # The lighthouse runs in Ray Train's actor: its quorum lines are in that worker's log.
    logs = glob.glob(os.path.join(os.environ.get("TMPDIR", "/tmp"), "ray", "session_*", "logs", "worker-*"))
    out["lighthouse_quorums"] = sorted(
        (q for path in logs for q in ft.lighthouse_quorums(path)), key=lambda q: q["created"]
    )
    recs = read_progress(progress)
    out.update(ft.analyse_torchft(recs, out))
    out.update(replacement_facts(recs, out))
    # Written before the cluster stops: a hung controller may hold ray.shutdown up, and the
    # deadline then kills the process group with the figures already on disk.
    write_json(cfg["out"], out)
    stopper = threading.Thread(target=started.stop, daemon=True)
    stopper.start()
    stopper.join(timeout=25)
    os._exit(0)


def _completion(
    recs: list[dict[str, Any]], hung: bool, fit_out: dict[str, Any], steps_total: int, t0: float
) -> dict[str, Any]:
    """Whether ``fit()`` returned, and how: ``status``, ``completed``, ``completion_reason``."""
    out: dict[str, Any] = {}
    ends = [r for r in recs if r["kind"] == "end"]
    last = [r for r in recs if r["kind"] == "step" and r["committed"] and r["step"] >= steps_total]
    out["last_step_done_ts"] = max((r["ts"] for r in last), default=None)
    out["replicas_ended"] = sorted(r["rank"] for r in ends)
    if hung:
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
    return out


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
