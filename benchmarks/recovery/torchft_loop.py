"""What both TorchFT sides share: the replica's state, the Manager's common settings, the
training loop (run in each replica process), the driver thread that kills a node and asks for
it back (run in the side's child process), and how a run is read afterwards.

TorchFT keeps its own semantics: each replica trains a fixed 3 rows per step, so the global
batch shrinks from 12 to 9 when a replica is lost (ours and Ray Train keep 12).
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from benchmarks.harness.kill import rejoin_figures
from benchmarks.recovery.progress import kill_rank_node, read_progress
from benchmarks.recovery.scenario import GLOBAL_BATCH, NODES, first_step_work


@dataclass
class Replica:
    """One replica's model, optimizer and schedule, with the callbacks torchft heals it
    through; ``healed_ts`` is when it last loaded a live peer's state."""

    spec: Any
    model: Any
    optimizer: Any
    scheduler: Any
    healed_ts: dict[str, float | None] = field(default_factory=lambda: {"ts": None})

    @classmethod
    def build(cls, raw_spec: dict[str, Any]) -> Replica:
        from elastic.models.gpt import build_model
        from elastic.optim import build_optimizer
        from jobs import JobSpec

        spec = JobSpec.from_dict(raw_spec)
        model = build_model(spec.model, spec.seed)
        model.train()
        optimizer, scheduler = build_optimizer(model, spec.train)
        return cls(spec, model, optimizer, scheduler)

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.model.load_state_dict(sd["model"])
        self.optimizer.load_state_dict(sd["optimizer"])
        self.scheduler.load_state_dict(sd["scheduler"])
        self.healed_ts["ts"] = time.time()

    def state_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
        }

    def manager_kwargs(self) -> dict[str, Any]:
        """The ``Manager`` settings both sides use: a replica group of one process, gloo with
        a 10 s timeout, the survivors allowed to go on alone."""
        from datetime import timedelta

        from torchft import ProcessGroupGloo

        return {
            "pg": ProcessGroupGloo(timeout=timedelta(seconds=10)),
            "load_state_dict": self.load_state_dict,
            "state_dict": self.state_dict,
            "min_replica_size": 1,
            "rank": 0,
            "world_size": 1,
            "timeout": timedelta(seconds=10),
            "quorum_timeout": timedelta(seconds=60),
            "connect_timeout": timedelta(seconds=10),
        }


def torchft_steps(manager, replica: Replica, corpus, slot: int, progress: str, log, wait_ready: bool) -> None:
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

    spec, model, optimizer, scheduler = replica.spec, replica.model, replica.optimizer, replica.scheduler
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
                healed_ts=replica.healed_ts["ts"],
            )
    finally:
        # As Ray's example: without it, a replica that finishes can strand a late peer.
        manager.shutdown(wait=False)


def start_kill_watch(
    out: dict[str, Any], cluster, progress: str, cfg: dict[str, Any], stop: threading.Event, return_due: list[float]
) -> threading.Thread:
    """A driver thread: kill rank's node once step k is committed by the full quorum; then,
    once a step is committed without it, ask for the node back after ``return_delay_s``
    (``return_due``; the main thread adds it: Ray starts nodes from the main thread only)."""

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

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    return watcher


def torchft_version() -> str | None:
    import torchft

    from benchmarks.harness.results import package_version

    return getattr(torchft, "__version__", None) or package_version("torchft")


def lighthouse_quorums(log_path: str) -> list[dict[str, Any]]:
    """The quorums a lighthouse logged to ``log_path``: id, size, and its own creation stamp."""
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
    at_size = [(r["step"], r["ts"]) for r in smaller if r["participants"] == size and r["step"] >= first_step]
    res.update(first_step_work(res["recovery_s"], at_size, GLOBAL_BATCH // NODES))
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
    res.update(_rejoin(recs, committed, out))
    return res


def _rejoin(recs: list[dict[str, Any]], committed: list[dict[str, Any]], out: dict[str, Any]) -> dict[str, Any]:
    """How long the new replica (progress index NODES) took, from its node being back, to
    commit a step with every replica."""
    res: dict[str, Any] = {}
    if not out.get("node_added_done_ts"):
        return res
    new = [r for r in committed if r["rank"] == NODES and r["participants"] == NODES]
    start = next((r for r in recs if r["kind"] == "start" and r["rank"] == NODES), None)
    if new:
        note = (
            "node up (Cluster.add_node returned) -> the new replica's first committed step with every "
            "replica (a new process: imports, model build, Manager, then healed from a live peer over HTTP)"
        )
        res.update(rejoin_figures(out, new[0]["ts"], note))
        if start is not None:
            res["rejoin_from_process_start_s"] = new[0]["ts"] - start["started_at"]
        if start is not None and new[0].get("healed_ts"):
            res["heal_state_loaded_after_process_start_s"] = new[0]["healed_ts"] - start["started_at"]
    return res
