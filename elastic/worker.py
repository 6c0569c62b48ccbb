"""The worker: one Ray actor per rank, hosting a torch.distributed process.

The actor outlives process groups. On an elastic resize the controller calls
``configure`` again: the actor destroys its process group, joins a fresh one with the
survivors, rebuilds its mesh and wrappers (a new ``TrainEngine``) and restores state from
the memory tier. Process, imports and CPU buffers survive; nothing is restarted.

Two concurrency groups keep the actor observable while it trains:

* ``train`` (one thread): ``configure`` and ``run``, the only code that touches the model
  or the process group;
* ``control``: ``poll`` (heartbeat + drained per-step results), ``request_stop``,
  snapshot queries and transfers. A worker stopped with SIGSTOP answers none of these,
  which is how the controller tells a silent worker from a slow collective.

Errors inside ``run`` are recorded and returned, never raised mid-collective: after any
error the worker destroys its process group, which frees peers blocked in a collective
within milliseconds (gloo reports "Connection closed by peer").
"""

from __future__ import annotations

import collections
import faulthandler
import gc
import math
import os
import random
import signal
import socket
import threading
import time
from datetime import timedelta
from typing import Any

import numpy as np
import ray
import torch
import torch.distributed as dist

from elastic.checkpoint.memory_tier import MemoryTier, Snapshot
from elastic.data import BatchLayout, ParquetCorpus, RankStream, ray_data_batches
from elastic.errors import PeerCollectiveError
from elastic.parallel.dims import ParallelDims
from elastic.parallel.engine import TrainEngine
from elastic.parallel.sockets import GroupSockets
from elastic.policies import LossMonitor
from elastic.testing.faults import WorkerFaults

CONCURRENCY_GROUPS = {"train": 1, "control": 4}


# Dense fp32 (TF32 tensor-core) peak FLOP/s per device, for MFU; None where unknown (CPU).
_PEAK_TF32 = {"H200": 494.7e12, "H100": 494.7e12, "A100": 156e12, "L40S": 183e12}


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in _PEAK_TF32.items() if k in name), None)


def capture_rng() -> dict[str, str]:
    """This process's RNG states (torch CPU, numpy, Python) as hex strings.

    Strings, not lists of ints: a snapshot copies its plain data every step, and walking
    ~6,000 list items cost about half a millisecond per step.
    """
    np_state = np.random.get_state()
    py_state = random.getstate()
    return {
        "torch": torch.get_rng_state().numpy().tobytes().hex(),
        "numpy": np_state[1].astype(np.uint32).tobytes().hex() + f":{np_state[2]}",
        "python": np.asarray(py_state[1], dtype=np.uint64).tobytes().hex(),
    }


def restore_rng(states: dict[str, Any]) -> None:
    """Set the RNG states saved by :func:`capture_rng` (a list of ints for torch: older snapshots)."""
    t = states.get("torch")
    if isinstance(t, str):
        torch.set_rng_state(torch.frombuffer(bytearray(bytes.fromhex(t)), dtype=torch.uint8))
    elif t is not None:
        torch.set_rng_state(torch.tensor(t, dtype=torch.uint8))
    n = states.get("numpy")
    if isinstance(n, str):
        key, pos = n.split(":")
        np.random.set_state(("MT19937", np.frombuffer(bytes.fromhex(key), dtype=np.uint32), int(pos)))
    p = states.get("python")
    if isinstance(p, str):
        random.setstate((3, tuple(int(x) for x in np.frombuffer(bytes.fromhex(p), dtype=np.uint64)), None))


def _clear_dtensor_caches() -> None:
    """DTensor's sharding-propagation caches key on device meshes, keeping their groups alive."""
    from torch.distributed.tensor import DTensor

    propagator = DTensor._op_dispatcher.sharding_propagator
    for name in ("propagate_op_sharding", "_propagate_tensor_meta_cached"):
        cached = getattr(propagator, name, None)
        if hasattr(cached, "cache_clear"):
            cached.cache_clear()


def _is_collective_error(exc: BaseException) -> bool:
    text = str(exc)
    return isinstance(exc, (RuntimeError, dist.DistBackendError)) and any(
        marker in text
        for marker in ("Connection closed", "Connection reset", "Timed out", "timed out", "Broken pipe", "gloo", "NCCL")
    )


def _sender(peer: Any, timeout_s: float):
    """Deliver a snapshot to ``peer`` (a TrainWorker): serialise now, confirm later."""

    def send(snap: Snapshot):
        ref = peer.store_replica.remote(snap.to_wire())  # the arguments are serialised here

        def delivered() -> None:
            if not ray.get(ref, timeout=timeout_s):
                raise RuntimeError(f"the peer refused the snapshot of step {snap.step}: it has left that layout")

        return delivered

    return send


@ray.remote(concurrency_groups=CONCURRENCY_GROUPS, max_restarts=0)
class TrainWorker:
    def __init__(self, spec: Any, corpus_uri: str, faults: list[dict] | None = None):
        self.spec = spec
        self.corpus_uri = corpus_uri
        self.rank = -1
        self.dims: ParallelDims | None = None
        self.engine: TrainEngine | None = None
        self.stream: RankStream | None = None
        self.corpus: ParquetCorpus | None = None
        self.tier: MemoryTier | None = None
        self.step = 0
        self.batch_index = 0
        self.skip_batches: set[int] = set()
        self.monitor = LossMonitor(spec.elastic.loss_spike_factor)
        self._snapshot_blocking = 0.0
        self._results: collections.deque = collections.deque()
        self._beat = time.monotonic()
        self._phase = "idle"
        self._stop = threading.Event()
        self.faults = WorkerFaults(faults or [], stop=self._stop, beat=self._touch_beat)
        self._sockets = GroupSockets()
        # `kill -USR1 <pid>` dumps every thread's stack to the worker's log: how to see
        # where a hung rank is stuck.
        faulthandler.register(signal.SIGUSR1, all_threads=True)
        self.device = self._pick_device()
        self._peak_flops = peak_flops(self.device)
        # Ray sizes the actor's CPU share; torch would otherwise use every core per worker.
        torch.set_num_threads(max(1, int(spec.resources.cpus_per_worker)))

    # ------------------------------------------------------------------ control group
    @ray.method(concurrency_group="control")
    def info(self) -> dict[str, Any]:
        ctx = ray.get_runtime_context()
        return {"node_id": ctx.get_node_id(), "ip": ray.util.get_node_ip_address(), "pid": os.getpid()}

    @ray.method(concurrency_group="control")
    def free_port(self) -> int:
        with socket.socket() as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    # Task events (Ray's per-task state records sent to the GCS) are off for the polls: they
    # come several times a second per rank and nobody reads them.
    @ray.method(concurrency_group="control", enable_task_events=False)
    def poll(self) -> dict[str, Any]:
        """Heartbeat: progress counters plus the per-step results produced since last poll."""
        drained = []
        while self._results:
            drained.append(self._results.popleft())
        return {
            "rank": self.rank,
            "step": self.step,
            "phase": self._phase,
            "idle_s": time.monotonic() - self._beat,
            "results": drained,
        }

    def _touch_beat(self) -> None:
        self._beat = time.monotonic()

    @ray.method(concurrency_group="control")
    def request_stop(self) -> None:
        self._stop.set()

    @ray.method(concurrency_group="control")
    def snapshot_holdings(self) -> dict[int, list[int]]:
        """Owner rank -> steps this worker can serve from memory."""
        return {} if self.tier is None else self.tier.holdings()

    @ray.method(concurrency_group="control")
    def fetch_snapshot(self, owner: int, step: int) -> dict[str, Any]:
        """A snapshot this worker holds (taken by itself as rank ``owner``, or a peer
        replica), in ``Snapshot.to_wire`` form."""
        return self.tier.get(owner, step).to_wire()

    @ray.method(concurrency_group="control")
    def store_replica(self, wire: dict[str, Any]) -> bool:
        """Keep a peer's snapshot (``Snapshot.to_wire`` form); False when it belongs to a
        layout this worker has left."""
        self._ensure_tier()
        return self.tier.store_replica(Snapshot.from_wire(wire))

    # ------------------------------------------------------------------ train group
    @ray.method(concurrency_group="train")
    def configure(
        self,
        rank: int,
        dims: tuple[int, int, int],
        master: tuple[str, int],
        start: dict[str, Any],
        restore: dict[str, Any] | None,
        host_index: int,
    ) -> dict[str, Any]:
        """Join a (new) process group and get ready to train from ``start['step']``."""
        self._phase = "configure"
        self._beat = time.monotonic()
        self._teardown()
        if self.tier is not None:
            self.tier.replicate_to(None)  # nothing of the old layout is sent from now on
        dp, tp, pp = dims
        world = dp * tp * pp
        self.rank = rank
        self._sockets.before_init()
        t0 = time.perf_counter()
        dist.init_process_group(
            backend="nccl" if self.device.type == "cuda" else "gloo",
            init_method=f"tcp://{master[0]}:{master[1]}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=self.spec.elastic.collective_timeout_s),
        )
        init_s = time.perf_counter() - t0
        self.dims = ParallelDims(
            dp=dp, tp=tp, pp=pp, world_size=world, timeout=timedelta(seconds=self.spec.elastic.collective_timeout_s)
        )
        t1 = time.perf_counter()
        self.engine = TrainEngine(
            self.spec.model, self.spec.parallel, self.spec.train, self.dims, self.spec.seed, device=str(self.device)
        )
        build_s = time.perf_counter() - t1
        self._sockets.capture()  # the group's and its mesh's connections, cut on a failure
        self._ensure_tier()
        restore_s = 0.0
        self.step, self.batch_index = start["step"], start["batch_index"]
        if restore is not None:
            t2 = time.perf_counter()
            self._restore(restore)
            restore_s = time.perf_counter() - t2
        self.skip_batches = set(start.get("skip_batches", []))
        self.tier.layout = self._layout()  # replicas of the old layout arriving late are refused
        peer = start.get("replica_peer")
        self.tier.replicate_to(
            _sender(peer, self.spec.elastic.collective_timeout_s) if peer is not None else None,
            timeout_s=self.spec.elastic.collective_timeout_s,
        )
        self._read_plan, self._feeder_gen = start.get("read_plan"), -1  # the host feeder to read from (docs/data.md)
        if self.corpus is None and self._read_plan is None:
            self.corpus = ParquetCorpus(self.corpus_uri, self.spec.data.storage_options)
        self.stream = self._open_stream(self.batch_index, host_index * self.spec.data.stagger_s)
        from elastic.checkpoint.storage_tier import StorageUploader

        self.uploader = StorageUploader.create(
            self.spec, start.get("storage_uri"), rank, self.dims, self.tier, self._results, base_step=self.step
        )
        self._stop.clear()
        self._phase = "ready"
        self._beat = time.monotonic()
        reply = {"rank": rank, "init_s": init_s, "build_s": build_s, "restore_s": restore_s, "step": self.step}
        stats = self.__dict__.pop("_storage_restore", None)  # set by a restore from storage
        if stats is not None:
            reply["restore_bytes_read"] = stats["bytes_read"]
        return reply

    @ray.method(concurrency_group="train")
    def run(self, last_step: int) -> dict[str, Any]:
        """Train until ``last_step`` or an agreed stop; errors are returned, not raised."""
        self._phase = "train"
        self.tier.keep_layout(self._layout())  # every peer has restored by now
        failure = None
        try:
            while self.step < last_step:
                if self._train_one_step():
                    self._snapshot_now()
                    return {"status": "stopped", "step": self.step}
            self.tier.wait()
            return {"status": "done", "step": self.step}
        except Exception as exc:
            failure = self._classify(exc)
        finally:
            self._phase = "idle"
            self._beat = time.monotonic()
        # Outside the except block, so the traceback no longer pins the frames that hold
        # the process group: dropping every reference closes its connections, and peers
        # blocked in a collective with this rank fail at once instead of timing out.
        self._abort_group()
        failure["aborted_at"] = time.time()
        return failure

    @staticmethod
    def _classify(exc: Exception) -> dict[str, Any]:
        kind = "peer" if _is_collective_error(exc) or isinstance(exc, PeerCollectiveError) else "worker_error"
        if kind == "peer" and ("Timed out" in str(exc) or "timed out" in str(exc)):
            kind = "timeout"
        return {
            "status": "error",
            "kind": kind,
            "detail": f"{type(exc).__name__}: {str(exc)[:300]}",
            "error_at": time.time(),
        }

    # ------------------------------------------------------------------ the step
    def _train_one_step(self) -> bool:
        """One optimizer step; returns True when the group agreed to stop after it."""
        step = self.step + 1
        t0 = time.perf_counter()
        batch_index, micro_batches = self.stream.next(timeout=self.spec.elastic.collective_timeout_s)
        while batch_index in self.skip_batches:
            batch_index, micro_batches = self.stream.next(timeout=self.spec.elastic.collective_timeout_s)
        data_wait_s = time.perf_counter() - t0
        if self.faults.pending(step, self.rank):
            # Corrupt the weights only once the last snapshot is complete: the snapshot
            # copy overlaps the forward pass, which never writes the weights.
            self.tier.wait()
        self.faults.before_step(step, self.rank, self.engine)
        self._beat = time.monotonic()
        loss, stop = self.engine.forward_backward_agree(micro_batches, self._stop.is_set())
        self._beat = time.monotonic()
        anomaly = self.monitor.check(loss)
        if anomaly is not None:
            self._roll_back(step, batch_index, loss, anomaly)
            return stop
        wait_s = self.tier.wait()
        grad_norm = self.engine.optimizer_step()
        self.monitor.accept(loss)
        self.step, self.batch_index = step, batch_index + 1
        step_time = time.perf_counter() - t0
        result = {
            "type": "step",
            "step": step,
            "loss": loss,
            "grad_norm": grad_norm,
            "step_time_s": step_time,
            "data_wait_s": data_wait_s,
            "batch_index": batch_index,
            "peak_mem_bytes": self.engine.peak_mem_bytes(),
            "done_at": time.time(),
        }
        if self._peak_flops:
            # Model FLOPs of the whole global step over what every device could do meanwhile.
            result["mfu"] = self.engine.flops_per_step / (step_time * self.dims.world_size * self._peak_flops)
        self._report_snapshots(result, wait_s)
        ck = self.spec.checkpoint
        uploader = getattr(self, "uploader", None)  # storage tier: writes this snapshot's share
        to_storage = uploader is not None and uploader.due(step)
        if to_storage or (ck.memory_every_steps and step % ck.memory_every_steps == 0):
            t_state = time.perf_counter()
            state = self._full_state()
            gather_s = time.perf_counter() - t_state
            self._snapshot_blocking = gather_s + self.tier.snapshot_async(step, self.rank, state, self._layout())
            if to_storage:
                uploader.save(step, state, self._snapshot_blocking)
        if uploader is not None:
            uploader.secure(step)
        self._results.append(result)
        self._beat = time.monotonic()
        return stop

    def _report_snapshots(self, result: dict[str, Any], wait_s: float) -> None:
        """Attach the memory-tier snapshots that completed since the last step.

        ``blocking_s`` is what the training loop was held for: starting the copy, plus any
        wait for it to finish before the next optimizer step.
        """
        done = self.tier.unreported()
        if done:
            s = done[-1]
            result["snapshot"] = {
                "step": s.step,
                "blocking_s": self._snapshot_blocking + wait_s,
                "duration_s": s.copy_s,
                "bytes": s.nbytes,
            }

    def _open_stream(self, start_batch: int, delay_s: float) -> RankStream:
        d = self.spec.data
        layout = BatchLayout(self.spec.train.global_batch, self.spec.parallel.micro_batch, self.dims.dp)
        dp_rank = self.dims.coords(self.rank).dp_rank
        source = None
        if getattr(self, "_read_plan", None) is not None:
            from elastic.ingest.feeder import feeder_batches, open_feeder

            timeout = self.spec.elastic.collective_timeout_s
            gen = self._feeder_gen = getattr(self, "_feeder_gen", -1) + 1  # reset by configure
            old = self.__dict__.pop("_feeder", None)
            self._feeder = open_feeder(
                self._read_plan,
                self.corpus_uri,
                d,
                layout.global_batch,
                start_batch * layout.global_batch,
                timeout,
                gen,
            )
            if old is not None:  # a rollback: the old window may not hold the rows to replay
                ray.kill(old)
            # Configure returns once this host's first reads are done (its wave came).
            ray.get(self._feeder.ready.remote(), timeout=timeout * (d.waves + 2))
            source = feeder_batches(self._feeder, layout, dp_rank, start_batch, timeout)
            delay_s = 0.0  # the feeder staggers hosts by waves
        elif d.loader == "ray_data":
            # Enough batches to finish the run, with room for skipped ones.
            remaining = self.spec.train.steps - self.step + 64
            source = ray_data_batches(
                self.corpus_uri, d.storage_options, layout, dp_rank, start_batch, remaining, d.prefetch_steps
            )
        return RankStream(
            self.corpus, layout, dp_rank, start_batch, prefetch=d.prefetch_steps, start_delay_s=delay_s, source=source
        )

    def _snapshot_now(self) -> None:
        """Make sure the memory tier holds the live step (a resize restores from it)."""
        self.tier.wait()
        if self.step not in self.tier.steps():
            self.tier.snapshot_async(self.step, self.rank, self._full_state(), self._layout())
            self.tier.wait()

    def _roll_back(self, step: int, batch_index: int, loss: float, cause: str) -> None:
        """A NaN or spiking loss: do not commit; restore the newest own snapshot."""
        self.engine.zero_grad()
        self.tier.wait()
        snap = self.tier.newest()
        if snap is not None:
            self._load_snapshots({self.rank: snap})
            self.step = snap.step
            resume_batch = snap.objects["train/batch_index"]
        else:  # nothing to roll back to: the live state is still the last committed one
            resume_batch = batch_index
        if self.spec.elastic.on_bad_loss == "skip":
            self.skip_batches.add(batch_index)
        if resume_batch != self.stream.next_batch and not (
            resume_batch == batch_index and batch_index in self.skip_batches
        ):
            self.stream.close()
            self.stream = self._open_stream(resume_batch, 0.0)
        self.batch_index = resume_batch
        self._results.append(
            {
                "type": "anomaly",
                "cause": cause,
                "step": step,
                "loss": loss if math.isfinite(loss) else None,
                "batch_index": batch_index,
                "restored_step": self.step,
                "action": self.spec.elastic.on_bad_loss,
            }
        )

    # ------------------------------------------------------------------ state
    def _layout(self) -> dict[str, int]:
        d = self.dims
        return {"dp": d.dp, "tp": d.tp, "pp": d.pp, "zero": self.spec.parallel.zero}

    def _full_state(self) -> dict[str, Any]:
        return {
            "app": self.engine.state_dict(),
            "train": {
                "step": self.step,
                "batch_index": self.batch_index,
                "skip_batches": sorted(self.skip_batches),
                "rng": capture_rng(),
            },
        }

    def _restore(self, restore: dict[str, Any]) -> None:
        source = restore["source"]
        if source == "memory":
            snaps: dict[int, Snapshot] = {}
            for owner, holder in restore["holders"].items():
                if holder is None:  # this worker holds it itself
                    snaps[owner] = self.tier.get(owner, restore["step"])
                else:
                    snaps[owner] = Snapshot.from_wire(
                        ray.get(holder.fetch_snapshot.remote(owner, restore["step"]), timeout=120)
                    )
            self._load_snapshots(snaps)
            obj = next(iter(snaps.values())).objects
        else:
            from elastic.checkpoint.restore import load_from_storage

            obj = load_from_storage(self, restore)
        self.step = int(obj["train/step"])
        self.batch_index = int(obj["train/batch_index"])
        self.skip_batches = set(obj.get("train/skip_batches", []))
        restore_rng({k.removeprefix("train/rng/"): v for k, v in obj.items() if k.startswith("train/rng/")})

    def _load_snapshots(self, snaps: dict[int, Snapshot]) -> None:
        from elastic.checkpoint.restore import load_snapshots_into

        load_snapshots_into(self.engine, snaps)

    def _ensure_tier(self) -> None:
        if self.tier is None:
            self.tier = MemoryTier(self.device.type)

    def _pick_device(self) -> torch.device:
        if self.spec.resources.device == "cuda":
            ids = ray.get_gpu_ids()
            torch.cuda.set_device(0 if not ids else 0)
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _teardown(self) -> None:
        if getattr(self, "uploader", None) is not None:
            self.uploader.close()  # uploads of the old layout are dropped
            self.uploader = None
        if self.stream is not None:
            self.stream.close()
            self.stream = None
        feeder = self.__dict__.pop("_feeder", None)
        if feeder is not None:  # the old layout's feeder; every rank of it may end it
            try:
                ray.kill(feeder)
            except Exception:  # noqa: BLE001 - already gone with its node
                pass
        self._abort_group()
        self.engine = None

    def _abort_group(self) -> None:
        """Leave the process group so that peers blocked on this rank fail at once.

        gloo: shut down the group's TCP connections (see ``elastic.parallel.sockets``;
        references held in C++ would otherwise keep them open until the peers' timeout).
        NCCL: abort the communicators. Then drop every reference to the groups (engine,
        mesh, torch's mesh stack, DTensor caches) and destroy them.
        """
        from torch.distributed.device_mesh import _mesh_resources

        if dist.is_initialized() and dist.get_backend() == "nccl":
            try:
                dist.distributed_c10d._abort_process_group()
            except Exception as exc:  # already broken: destroyed below either way
                print(f"NCCL abort failed: {exc}", flush=True)
        else:
            self._sockets.cut()
        self.engine = None
        self.dims = None
        _mesh_resources.mesh_stack.clear()
        _clear_dtensor_caches()
        gc.collect()
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # a broken group may fail to tear down; it is gone either way
                pass
