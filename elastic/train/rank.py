"""``LoopRank``: one rank of a ``TorchTrainer`` job, hosted by a Ray actor for the job's
whole life, that enters the user's training loop (``train_loop_per_worker``) again after
every re-formation instead of being restarted.

It is the loop's payload on the rank runtime (``RankRuntime``, ``elastic/worker/runtime.py``,
shared with the built-in trainer's ``Rank``): the runtime holds what lives for the process,
across entries: the process group (``ReconfigurableProcessGroup``: the job's sealed store,
its generations, cutting a blocked collective), the device choice, the training thread, the
leave at exit. The payload's own, also across entries: the actor, its imports and CUDA
context, the checkpoints this rank reported or keeps for a peer, and the reports not yet
read by the driver. What lives for one entry: the ``Session`` the loop
sees (``elastic/train/session.py``), its loaders and shards, and what ``prepare_*``
registered. After an entry everything it made is dropped and collected (its models,
optimizers and groups): ``tests/train`` measures a survivor's resident memory over
repeated entries.

Two concurrency groups, as the built-in rank's (``elastic/worker/actor.py``): ``train``
runs ``run`` (the loop, and any join of a process group), ``control`` answers the driver
while the loop runs: ``poll``, ``abort_step``, ``request_stop``, ``reform`` and the
checkpoint copies a peer keeps (``store_replica``, ``fetch``, ``forget_before``). Every
message of either direction is typed (``elastic/train/loop_messages.py``); the names the
built-in rank also answers (``info``, ``poll``, ``abort_step``, ``request_stop``,
``store_replica``, ``run``) mean the same there (``RankPayload``, ``elastic/worker/runtime.py``).

A report (``report(metrics, checkpoint)`` in the loop) is agreed by every rank (one
two-int all-reduce: did any rank report a checkpoint, has the driver asked the group to
leave at one), numbered (the job's step), kept in memory with the checkpoint's files, copied
to the peer on another node before ``report`` returns, and uploaded to storage in the
background; the driver commits a checkpoint once every part of it is uploaded
(``elastic/train/checkpoints.py``).
"""

from __future__ import annotations

import gc
import inspect
import logging
import os
import queue
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import ray
import torch
import torch.distributed as dist

from elastic.train.checkpoint import Checkpoint, read_files, write_files
from elastic.train.data import Position
from elastic.train.loop_messages import (
    Entry,
    EntryOutcome,
    LoopError,
    LoopInfo,
    LoopPoll,
    LoopReport,
    Place,
    Restore,
    Restored,
    Upload,
)
from elastic.train.session import LoopExit, Session, TrainContext, set_session
from elastic.worker.process_group import is_collective_error
from elastic.worker.runtime import RankRuntime, rss_bytes

logger = logging.getLogger(__name__)

PEER_COPY_TIMEOUT_S = 60.0
FETCH_TIMEOUT_S = 120.0
REFORM_WAIT_S = 300.0  # a rank waiting in its step for the driver's new group


class LoopRank:
    """One rank of a user's loop (the body of the Ray actor ``TorchTrainer`` starts)."""

    def __init__(self, loop: bytes, device_type: str, timeout_s: float):
        # the loop and its config arrive pickled (``pickle_loop``) and are loaded here, so that a
        # loop this process cannot load (its module missing here, or raising at import) is an
        # error ``info`` reports with its own traceback, not an actor that died starting
        self.fn: Callable[..., Any] | None = None
        self.config: dict[str, Any] | None = None
        self.load_error: LoopError | None = None
        try:
            self.fn, self.config = ray.cloudpickle.loads(loop)
        except BaseException as exc:  # noqa: BLE001 - the driver fails the run with it
            self.load_error = LoopError.of(exc, __file__)
        self.device_type = device_type
        self.runtime = RankRuntime(device_type, timeout_s, connect_world_at_once=True)  # a loop may use any pair
        # stack dumps on SIGUSR1, the control threads above the loop's, the start-up heap frozen
        # (torch's threads: Ray's OMP_NUM_THREADS; freed memory: glibc's defaults, the loop's own)
        self.runtime.settle_process()
        self.place: Place | None = None
        self.index = 0
        self.session: Session | None = None
        self.held: dict[tuple[int, int], dict[str, bytes]] = {}  # (index, rank) -> files: own and peers'
        self._lock = threading.Lock()
        self._reports: list[LoopReport] = []
        self._uploads: list[Upload] = []
        self._stop_requested = False
        self._reform: queue.Queue[Place | None] = queue.Queue()
        self.waiting = False  # in a step, waiting for the driver's new group
        self.entries = 0
        self._threads: list[threading.Thread] = []
        self._restored: Restored | None = None  # this entry's restore
        self._restored_from = "memory"

    # ------------------------------------------------------------------ control group
    @ray.method(concurrency_group="control")
    def info(self) -> LoopInfo:
        w = self.runtime.where()
        return LoopInfo(w.node_id, w.ip, w.pid, tuple(self.runtime.gpus()), self.load_error)

    @ray.method(concurrency_group="control")
    def poll(self) -> LoopPoll:
        with self._lock:
            reports, self._reports = self._reports, []
            uploads, self._uploads = self._uploads, []
        generation = self.place.generation if self.place is not None else 0
        return LoopPoll(reports, uploads, self.waiting, generation, rss_bytes(), len(self.held))

    @ray.method(concurrency_group="control")
    def abort_step(self, generation: int = 0, links: frozenset | None = None) -> int:
        """A peer was lost: leave the step in flight. This rank's ``links`` (to the lost ranks;
        None: every one) are shut down, so a collective blocked on one fails here at once, and
        any report takes the loop back. Returns how many were cut; a late notice (of a
        ``generation`` older than this rank's): nothing."""
        if generation and self.place is not None and generation < self.place.generation:
            return 0  # (a newer one: its place is on the way to this rank, which must not join it)
        session = self.session
        if session is not None:
            session.exit.set()
        self.runtime.tier.yield_copy()  # a held step's snapshot copy gives way to the recovery
        if self.waiting or not self.runtime.connected():
            return 0  # already out of the group
        return self.runtime.cut(links)

    @ray.method(concurrency_group="control")
    def request_stop(self) -> None:
        """Leave the loop at the next boundary it can be continued from: a report that carries
        a checkpoint (the group grows there)."""
        self._stop_requested = True

    @ray.method(concurrency_group="control")
    def reform(self, place: Place | None) -> None:
        """The new group for a rank waiting in its step (None: leave the loop instead)."""
        self._reform.put(place)

    @ray.method(concurrency_group="control")
    def store_replica(self, index: int, rank: int, files: dict[str, bytes]) -> bool:
        """Keep a copy of ``rank``'s checkpoint files of report ``index`` (this rank is its peer)."""
        with self._lock:
            self.held[(index, rank)] = files
        return True

    @ray.method(concurrency_group="control")
    def fetch(self, index: int, rank: int) -> dict[str, bytes] | None:
        """``rank``'s checkpoint files of report ``index``, where this rank holds them."""
        return self.held.get((index, rank))

    @ray.method(concurrency_group="control")
    def forget_before(self, index: int) -> None:
        """Drop the checkpoints older than ``index`` (the driver keeps the newest in memory)."""
        with self._lock:
            for key in [k for k in self.held if k[0] < index]:
                del self.held[key]

    @ray.method(concurrency_group="control")
    def ping(self) -> int:
        return os.getpid()

    # ------------------------------------------------------------------ train group
    def run(self, entry: Entry) -> EntryOutcome:
        """Join ``entry``'s generation and run the loop once; what became of it."""
        self.runtime.enter("train")
        self.entries += 1
        self._stop_requested = False
        self._drain_reform()
        t0 = time.perf_counter()
        try:
            self._join(entry.place)
        except Exception as exc:  # noqa: BLE001 - a peer lost while joining: the driver re-forms
            self.runtime.leave()
            error = LoopError("collective", f"{type(exc).__name__}: {exc}", type(exc).__name__)
            return EntryOutcome.raised(error, self.index)
        join_s = time.perf_counter() - t0
        self.index = entry.index
        ckpt_dir = None
        try:
            checkpoint, positions = None, []
            self._restored = None
            if entry.restore is not None:
                ckpt_dir = tempfile.mkdtemp(prefix=f"elastic-{entry.run_id}-restore-")
                t_restore = time.perf_counter()
                checkpoint, positions = self._materialize(entry.restore, ckpt_dir), entry.restore.positions
                self._restored = Restored(self._restored_from, time.perf_counter() - t_restore)
            self.session = self._session(entry, checkpoint, positions)
            set_session(self.session)
            if self.fn is None:
                assert self.load_error is not None
                return EntryOutcome.raised(self.load_error, self.index, join_s)
            with self.runtime.running():
                result = _call(self.fn, self.config)
            return EntryOutcome("finished", self.index, join_s, _plain(result))
        except LoopExit:
            return EntryOutcome("exited", self.index, join_s)
        except BaseException as exc:  # noqa: BLE001 - the loop's own error or a lost peer's
            return EntryOutcome.raised(LoopError.of(exc, __file__), self.index, join_s)
        finally:
            set_session(None)
            self.session = None
            self.waiting = False
            self.runtime.leave()
            if ckpt_dir:
                shutil.rmtree(ckpt_dir, ignore_errors=True)
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    def shutdown(self) -> None:
        for t in self._threads:
            t.join(timeout=60)
        self.runtime.close()

    # ------------------------------------------------------------------ inside the loop
    def _join(self, place: Place) -> None:
        self.place = place
        try:
            self.runtime.join(place.generation, place.rank, place.world, place.store, place.secret)
        finally:
            self.runtime.settled()
        if place.world > 1:
            dist.barrier()  # every pair connected (gloo eagerly): the sockets to cut on a loss
        self.runtime.built()

    def _session(self, entry: Entry, checkpoint: Checkpoint | None, positions: list[dict[str, Any]]) -> Session:
        p = entry.place
        context = TrainContext(
            world_size=p.world,
            world_rank=p.rank,
            local_rank=p.local_rank,
            local_world_size=p.local_world,
            node_rank=p.node_rank,
            experiment_name=entry.experiment_name,
            trial_name=entry.trial_name,
            storage_path=entry.storage_dir,
        )
        session = Session(context=context, checkpoint=checkpoint, on_report=self._on_report)
        session.device = self.runtime.device(p.local_rank)
        session.state["positions"] = [Position.from_dict(d) for d in positions]
        session.state["loaders"] = []
        session.state["rank"] = self
        session.state["storage_dir"] = entry.storage_dir
        from elastic.train.data import ExactShard

        for name in sorted(entry.datasets):
            blocks, split = entry.datasets[name]
            shard = ExactShard(blocks, self.current_group, split, session.device)
            if len(session.state["loaders"]) < len(positions):
                shard.restore(session.state["positions"][len(session.state["loaders"])])
            session.state["loaders"].append(shard)
            session.shards[name] = shard
        return session

    def current_group(self) -> tuple[int, int]:
        p = self.place
        return (p.rank, p.world) if p is not None else (0, 1)

    def await_reform(self) -> Place | None:
        """In a step whose collective failed: wait for the driver's new group, join it."""
        self.waiting = True
        self.runtime.leave()
        try:
            place = self._reform.get(timeout=REFORM_WAIT_S)
        except queue.Empty:
            place = None
        self.waiting = False
        if place is None:
            raise LoopExit("the group is re-formed: the loop is entered again")
        self._join(place)
        session = self.session
        if session is not None:
            session.exit.clear()  # the abort's: this rank goes on in place
            c = session.context
            c.world_size, c.world_rank, c.local_rank = place.world, place.rank, place.local_rank
            c.local_world_size, c.node_rank = place.local_world, place.node_rank
        return place

    def _drain_reform(self) -> None:
        while not self._reform.empty():
            self._reform.get_nowait()

    def _on_report(self, metrics: dict[str, Any], checkpoint: Checkpoint | None) -> None:
        t_report = time.perf_counter()
        session = self.session
        assert session is not None
        guard = session.state.get("guard")
        if guard is not None and guard.take_discarded():
            return  # the step this report follows was not applied: it is run again
        # the place this step was trained at (a recovery below re-forms the group under it)
        generation = self.place.generation if self.place is not None else 0
        rank, world = session.context.world_rank, session.context.world_size
        reported = files = read_files(checkpoint.path) if checkpoint is not None else None
        try:  # the report's collectives: a held step's lost peer is recovered here too
            any_ckpt, leave = self._agree(checkpoint is not None, self._stop_requested)
            if any_ckpt and world > 1:
                files = self._own_files(reported, rank)
        except Exception as exc:
            if guard is None or not guard.active or not is_collective_error(exc):
                raise
            if not guard.recover():
                return  # this rank's step was rolled back: the report goes with it
            any_ckpt, leave = checkpoint is not None, False
            files = reported  # all of it: no merge
        index = self.index + 1
        positions = [lo.position.as_dict() for lo in session.state["loaders"]]
        if files is not None:
            with self._lock:
                self.held[(index, rank)] = files
            self._copy_to_peer(index, rank, files)
            self._upload(session.state["storage_dir"], index, rank, files)
        ledger = [list(lo.served) for lo in session.state["loaders"]]
        rows_served = None  # no loader of the platform's: the loop's throughput is not known here
        if session.state["loaders"]:
            rows_served = sum(lo.rows_served for lo in session.state["loaders"])
            for lo in session.state["loaders"]:
                lo.rows_served = 0
        report = LoopReport(
            index=index,
            rank=rank,
            generation=generation,
            world=world,
            metrics=_plain(metrics),
            ts=time.time(),
            checkpoint=files is not None,
            positions=positions,
            rows=ledger,
            rows_served=rows_served,
            blocking_s=time.perf_counter() - t_report,
            bytes=sum(len(v) for v in files.values()) if files is not None else 0,
            restored=self._restored,
        )
        with self._lock:
            self._reports.append(report)
        self.index = index
        if any_ckpt and leave:
            session.leave = True  # every rank leaves at this report (the group grows here)

    def _own_files(self, files: dict[str, bytes] | None, rank: int) -> dict[str, bytes] | None:
        """The files this rank contributes to the merged checkpoint: a name two ranks report
        is the lowest rank's (one more small collective, at checkpoint reports only)."""
        names: list[list[str]] = [[] for _ in range(dist.get_world_size())]
        dist.all_gather_object(names, sorted(files or ()))
        taken = {n for lower in names[:rank] for n in lower}
        mine = {k: v for k, v in (files or {}).items() if k not in taken}
        return mine or None

    def _agree(self, has_checkpoint: bool, leave: bool) -> tuple[bool, bool]:
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return has_checkpoint, leave
        device = torch.device("cuda", torch.cuda.current_device()) if self.runtime.group.backend == "nccl" else None
        flags = torch.tensor([int(has_checkpoint), int(leave)], dtype=torch.int32, device=device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return bool(flags[0]), bool(flags[1])

    def _copy_to_peer(self, index: int, rank: int, files: dict[str, bytes]) -> None:
        """The checkpoint reaches a peer on another node before ``report`` returns."""
        place = self.place
        if place is None or place.peer is None:
            return
        ref = place.peer.store_replica.remote(index, rank, files)
        deadline = time.monotonic() + PEER_COPY_TIMEOUT_S
        session = self.session
        try:
            while not ray.wait([ref], timeout=0.05)[0]:
                if session is not None and session.exit.is_set():
                    # a peer was lost (maybe this one, which Ray takes a second or more to fail):
                    # the recovery does not wait; a live peer still stores it, storage has it
                    logger.info("checkpoint %d: the copy to the peer goes on without this report", index)
                    return
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no answer in {PEER_COPY_TIMEOUT_S:.0f} s")
            ray.get(ref)
        except Exception as exc:  # noqa: BLE001 - a lost peer: storage keeps the copy
            logger.warning("checkpoint %d: no copy on the peer (%s)", index, exc)

    def _upload(self, storage_dir: str, index: int, rank: int, files: dict[str, bytes]) -> None:
        def upload() -> None:
            from elastic.train.checkpoints import upload_part

            try:
                outcome = Upload(index, rank, manifest=upload_part(storage_dir, index, files))
            except Exception as exc:  # noqa: BLE001 - reported: the driver records the failure
                outcome = Upload(index, rank, error=f"{type(exc).__name__}: {exc}")
            with self._lock:
                self._uploads.append(outcome)

        thread = threading.Thread(target=upload, name=f"upload-{index}", daemon=True)
        thread.start()
        self._threads = [t for t in self._threads if t.is_alive()] + [thread]

    def _materialize(self, restore: Restore, directory: str) -> Checkpoint:
        """The checkpoint's files in ``directory``: from this rank's memory, a peer's, storage last."""
        import ray

        from elastic.train.checkpoints import read_committed

        self._restored_from = "memory"  # its own or a peer's
        for rank, holders in restore.parts if restore.parts else [(-1, [])]:  # no part in memory: storage
            files = self.held.get((restore.index, rank))
            for holder in holders:
                if files is not None:
                    break
                try:
                    files = ray.get(holder.fetch.remote(restore.index, rank), timeout=FETCH_TIMEOUT_S)
                except Exception as exc:  # noqa: BLE001 - that holder is gone: the next one
                    logger.info("checkpoint %d part %d: holder unavailable (%s)", restore.index, rank, exc)
            if files is None:
                break
            write_files(files, directory)
        else:
            return Checkpoint.from_directory(directory)
        if restore.storage_dir is None:
            raise RuntimeError(f"checkpoint {restore.index}: no copy in memory and none committed")
        shutil.rmtree(directory, ignore_errors=True)
        os.makedirs(directory)
        self._restored_from = "storage"
        write_files(read_committed(restore.storage_dir), directory)
        return Checkpoint.from_directory(directory)


def pickle_loop(fn: Callable[..., Any], config: dict[str, Any] | None) -> bytes:
    """The loop and its config as ``LoopRank`` takes them (Ray's own pickler, by reference
    where the driver imports them from a module)."""
    return ray.cloudpickle.dumps((fn, config))


def _call(fn: Callable[..., Any], config: dict[str, Any] | None) -> Any:
    params = [
        p
        for p in inspect.signature(fn).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty
    ]
    return fn(config if config is not None else {}) if params else fn()


def _plain(value: Any) -> Any:
    """A value that pickles without the loop's own classes (metrics, the loop's return)."""
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.detach().cpu().tolist()
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "item") and callable(value.item):
        try:
            return value.item()
        except Exception:  # noqa: BLE001 - not a scalar
            return value
    return value


__all__ = ["LoopRank", "pickle_loop"]
