"""Side ``torchft``: torchft 0.2.0 standalone (``Manager`` + ``LighthouseServer`` with a 1 s
heartbeat timeout, ``ProcessGroupGloo`` with a 10 s timeout, one ``Manager.allreduce`` of the
flattened gradients per step, ``should_commit`` before the optimizer step), one replica group
of one process per node, each a Ray task (``num_cpus=1``) on the same cluster shape, started
together (each waits until all 4 Managers heartbeat). The survivors keep training per step;
a node is added back after the first step without the lost replica, and a new replica heals
from a live peer.

Standalone rather than Ray Train's ``TorchftConfig`` (that is side ``raytrain_torchft``):
here every process is under the benchmark's control. When the kill lands inside a gradient
allreduce, the survivors wait for gloo's timeout (10 s here; torchft's default is 60 s)
before the smaller quorum forms; between two allreduces, the lighthouse drops the replica
after its 1 s heartbeat timeout. torchft must be importable (``make bench-deps``, or
``--torchft-path DIR``); otherwise the side is reported as skipped, with the reason.

``torchft_replica`` runs in the replicas' Ray tasks; ``torchft_child`` in the side's child
process (the lighthouse lives there).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from benchmarks.harness.cluster import start_cluster
from benchmarks.harness.kill import add_node_now
from benchmarks.harness.proc import arm_deadline
from benchmarks.harness.results import write_json
from benchmarks.recovery.progress import append_line, read_progress, report_skipped, side_inputs
from benchmarks.recovery.scenario import NODES, TORCHFT_HEARTBEAT_TIMEOUT_MS, TORCHFT_JOIN_TIMEOUT_MS
from benchmarks.recovery.torchft_loop import (
    Replica,
    analyse_torchft,
    lighthouse_quorums,
    start_kill_watch,
    torchft_steps,
    torchft_version,
)


def torchft_replica(config: dict[str, Any]) -> dict[str, Any]:
    """One torchft replica group of one process: train until ``steps`` are committed."""
    import ray
    import torch
    import torch.distributed as dist
    from torchft import Manager

    from elastic.ingest.corpus import ParquetCorpus

    torch.set_num_threads(1)
    idx, progress = config["replica"], config["progress"]
    t_start = time.time()

    def log(**rec: Any) -> None:
        append_line(progress, {"ts": time.time(), "rank": idx, **rec})

    log(kind="start", pid=os.getpid(), node_id=ray.get_runtime_context().get_node_id(), started_at=t_start)
    replica = Replica.build(config["spec"])
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        **replica.manager_kwargs(),
        replica_id=f"replica_{idx}",
        store_addr="127.0.0.1",
        store_port=store.port,
        lighthouse_addr=config["lighthouse"],
        hostname="127.0.0.1",
    )
    corpus = ParquetCorpus(replica.spec.data.source)
    torchft_steps(manager, replica, corpus, idx, progress, log, config.get("wait_ready"))
    log(kind="end", step=manager.current_step())
    return {"replica": idx, "step": manager.current_step()}


def torchft_child(cfg: dict[str, Any]) -> None:
    out: dict[str, Any] = {"side": "torchft", "lighthouse_heartbeat_timeout_ms": TORCHFT_HEARTBEAT_TIMEOUT_MS}
    arm_deadline(cfg["side_timeout"], cfg["out"], out)
    try:
        import torchft  # noqa: F401
        from torchft.coordination import LighthouseServer
    except Exception as exc:
        report_skipped(cfg, out, "torchft", exc)
    import ray

    out["torchft_version"] = torchft_version()
    spec, progress = side_inputs(cfg)
    t0 = time.time()
    started = start_cluster(NODES)
    cluster = started.cluster
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
    replica_task = ray.remote(num_cpus=1, max_retries=0)(torchft_replica)
    base = {"spec": spec, "progress": progress, "lighthouse": lighthouse.address()}
    refs = {i: replica_task.remote(dict(base, replica=i, wait_ready=True)) for i in range(NODES)}
    stop = threading.Event()
    new_ref: list[Any] = []
    return_due: list[float] = []
    watcher = start_kill_watch(out, cluster, progress, cfg, stop, return_due)
    survivors_done: dict[int, Any] = {}
    try:
        pending = dict(refs)
        deadline = time.time() + cfg["side_timeout"] - 20
        while pending and time.time() < deadline:
            if return_due and not new_ref and time.time() >= return_due[0]:
                add_node_now(out, cluster, num_cpus=1)  # from the main thread, as Ray requires
                new_ref.append(replica_task.remote(dict(base, replica=NODES)))
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
        started.stop()
    out["lighthouse_quorums"] = lighthouse_quorums(os.path.join(cfg["work"], "log.txt"))
    out.update(analyse_torchft(read_progress(progress), out))
    write_json(cfg["out"], out)
    os._exit(0)
