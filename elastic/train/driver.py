"""``LoopDriver``: runs a user's loop on an elastic group of ``LoopRank`` actors (driver
side of ``TorchTrainer.fit``).

The life of a run:

1. Start ``max`` workers (each ``resources_per_worker``); go on when ``min`` are up, the
   others join as they come (growth). A worker that cannot load the loop (``LoopRank``
   loads it, and says why it could not) fails the run as soon as ``min`` cannot be reached,
   with that error.
2. Form generation 1 (the job's ``RendezvousStore``, sealed per job) and enter the loop on
   every rank, from the newest committed checkpoint when the run is resumed.
3. Watch: each rank's reports (its steps, checkpoints, uploads) and its run. A step is the
   report index every rank of the generation has reached; a checkpoint is committed in
   storage once each part of it is uploaded.
4. A lost worker (its actor gone, or a survivor's collective failed and the lost one does
   not answer): the survivors are pulled out of their collectives (``abort_step``), then either
   re-formed in place, inside their running loop (every survivor is waiting in a held step:
   ``elastic/train/step_guard.py``), or their loop is entered again at the new size from
   the newest checkpoint, which a rank or its peer holds in memory (storage last).
5. Growth: a worker that came up while the group is below ``max`` joins at the next report
   that carries a checkpoint (every rank leaves its loop there, and all enter again).
6. The end: every rank's loop returned. Uploads are waited for, the run files written.
   A run directory that can no longer be written (``EventLog.fault``) ends the run failed
   at once, as it ends ``elastic run``.

``FailureConfig.max_failures`` counts recoveries as Ray Train does (0: the first lost
worker ends the run; -1: no limit). An exception the loop raises on every rank is the
loop's own error: the run ends with it at once, spending no retry.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections import defaultdict
from typing import Any

import ray

from elastic.control.diagnosis import NODE_PROBE_S, RayletProbe
from elastic.control.timing import PhaseTimer
from elastic.events import Recovery
from elastic.report.metrics import start_metrics
from elastic.train import checkpoints as ckpts
from elastic.train.loop_messages import Entry, EntryOutcome, LoopInfo, LoopPoll, LoopReport, Place, Restore, Upload
from elastic.train.loop_record import Job, LoopFailed, Worker, died_starting, exception_of, worker_exceptions
from elastic.train.rank import LoopRank, pickle_loop
from elastic.train.run_files import LoopRunFiles
from elastic.worker.process_group import RendezvousStore

logger = logging.getLogger(__name__)

TICK_S = 0.02
PING_TIMEOUT_S = 1.5  # a live rank's control thread answers in milliseconds, whatever its loop does
START_TIMEOUT_S = float(os.environ.get("ELASTIC_TRAIN_START_TIMEOUT_S", "120"))
SETTLE_TIMEOUT_S = 30.0  # survivors reaching a wait or an end after an abort
UPLOAD_WAIT_S = 300.0


class LoopDriver:
    """The run files (``events.jsonl``, ``summary.json``) are written by ``LoopRunFiles``
    (``elastic/train/run_files.py``); ``job.callbacks`` hear every event and every step."""

    def __init__(self, job: Job):
        self.job = job
        self.files = LoopRunFiles(job.run_dir)
        job.callbacks.attach(self.files)
        self.live_metrics = start_metrics(job.name)  # Ray's live ``elastic_*`` metrics (docs/observability.md)
        if self.live_metrics is not None:
            self.live_metrics.recoveries = lambda: self.files.recoveries
            self.files.subscribe(self.live_metrics)
        self.raylets = RayletProbe()
        self.generation = 0
        self.members: list[Worker] = []
        self.spares: list[Worker] = []
        self.store: RendezvousStore | None = None
        self.reports: dict[int, dict[int, LoopReport]] = defaultdict(dict)
        self.steps = 0  # the newest index every rank reached
        self.metrics: list[dict[str, Any]] = []  # rank 0's, one per step
        self.parts: dict[int, set[int]] = {}  # index -> ranks that reported checkpoint files
        self.holders: dict[tuple[int, int], list[Any]] = {}
        self.manifests: dict[int, dict[int, dict[str, Any]]] = defaultdict(dict)
        self.positions: dict[int, list[dict[str, Any]]] = {}
        self.committed: list[dict[str, Any]] = []  # {index, path, metrics}: the kept ones
        self.settled: set[int] = set()  # indices committed (kept or pruned since) or failed
        self.newest_ckpt = 0  # the newest index with a complete checkpoint in memory
        self._newest_before: int | None = None  # the open outage's newest reported index
        self._growth_asked = False
        self.ledger: list[dict[str, Any]] = []  # every report: index, rank, world, rows
        self._loop: bytes | None = None  # the loop and its config, pickled once for every worker
        self._cannot_grow: str | None = None  # a worker started for growth could not load the loop

    @property
    def recoveries(self) -> list[Recovery]:
        return self.files.recoveries

    # ------------------------------------------------------------------ public
    def run(self) -> dict[str, Any]:
        t0 = time.monotonic()
        status, error, values = "failed", None, []
        try:
            try:
                restore = self._resumed()
                self.store = RendezvousStore(ray.util.get_node_ip_address(), self.job.collective_timeout_s)
                self._start_workers()
                values = self._train(restore)
                status = "succeeded"
            except LoopFailed as exc:
                error = exc
            finally:
                self._wait_uploads()
                self._shutdown()
                self.job.callbacks.flush()
                self.files.end(status, self.steps, time.monotonic() - t0, str(error) if error is not None else None)
        finally:
            self.files.close()
            self.job.callbacks.close()
        return {
            "status": status,
            "error": error,
            "values": values,
            "metrics": self.metrics,
            "committed": self.committed,
            "steps": self.steps,
            "recoveries": self.recoveries,
            "rss": {i: w.rss for i, w in enumerate(self.members)},
            "held": {i: w.held for i, w in enumerate(self.members)},  # checkpoint parts in memory, per poll
            "ledger": self.ledger,
        }

    # ------------------------------------------------------------------ start
    def _resumed(self) -> Restore | None:
        records = ckpts.committed(self.job.storage_dir)
        if not records:
            return None
        rec = records[-1]
        index = int(rec["index"])
        self.committed = [
            {
                "index": int(r["index"]),
                "path": ckpts.checkpoint_dir(self.job.storage_dir, int(r["index"])),
                "metrics": r.get("metrics", {}),
                "positions": r.get("positions", []),
            }
            for r in records
        ]
        self.steps = index
        return Restore(index, [], ckpts.checkpoint_dir(self.job.storage_dir, index), rec.get("positions", []))

    def _spawn(self, n: int) -> list[Worker]:
        res = dict(self.job.resources)
        options: dict[str, Any] = {
            "num_cpus": res.pop("CPU", 0.0),
            "num_gpus": res.pop("GPU", 0.0),
            "max_restarts": 0,
        }
        if "memory" in res:
            options["memory"] = res.pop("memory")
        if res:
            options["resources"] = res
        if self.job.placement_strategy in ("SPREAD", "STRICT_SPREAD"):
            options["scheduling_strategy"] = "SPREAD"
        cls = _REMOTE.options(**options)
        device = "cuda" if self.job.use_gpu else "cpu"
        if self._loop is None:
            self._loop = pickle_loop(self.job.fn, self.job.config)
        out = []
        for _ in range(n):
            actor = cls.remote(self._loop, device, self.job.collective_timeout_s)
            out.append(Worker(actor, actor.info.remote()))
        self._know_raylets()
        return out

    def _know_raylets(self) -> None:
        """The raylets' addresses, to tell a lost node from a lost actor (``RayletProbe``)."""
        try:
            nodes = ray.nodes()
        except Exception:  # noqa: BLE001 - the GCS is busy: the addresses known stay
            return
        alive = [n for n in nodes if n.get("Alive")]
        self.raylets.update({n["NodeID"]: (n["NodeManagerAddress"], n["NodeManagerPort"]) for n in alive})

    def _start_workers(self) -> None:
        pending = self._spawn(self.job.max_workers)
        target = max(self.job.min_workers, min(self.job.max_workers, _fits(self.job.resources)))
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            self._adopt_ready(pending)
            if len(self.spares) >= target:
                break  # as many as the cluster holds now; the rest join as they come
            unresolved = sum(1 for w in pending if not w.resolved)
            if len(self.spares) + unresolved < self.job.min_workers:
                break  # too many could not start: the minimum cannot be reached
            time.sleep(0.05)
        failed = [w for w in pending if w.resolved and not w.node_id]
        self.spares.extend(w for w in pending if w not in self.spares and w not in failed)
        ready = [w for w in self.spares if w.node_id]
        errors = [w for w in failed if w.start_error is not None]
        if len(ready) < self.job.min_workers and errors:
            raise self._start_failed(pending, errors)
        if len(ready) < self.job.min_workers:
            raise LoopFailed(
                f"ScalingConfig.num_workers: only {len(ready)} of at least {self.job.min_workers} workers started "
                f"within {START_TIMEOUT_S:.0f} s (resources per worker: {self.job.resources})"
            )
        if errors:
            logger.warning(
                "%d worker(s) could not start the training loop (the run goes on with %d): %s",
                len(errors),
                len(ready),
                errors[0].start_error.error,  # type: ignore[union-attr]
            )

    def _start_failed(self, pending: list[Worker], errors: list[Worker]) -> LoopFailed:
        """The workers could not start the loop (its module does not import there, or raises
        at import; the actor's own start raised): the run fails now with that error, its type,
        message and traceback, as the ``failure`` event's detail (``worker_error``)."""
        first = errors[0].start_error
        assert first is not None
        now = time.monotonic()
        detail = f"{first.error} (raised starting the training loop on {len(errors)} worker(s))"
        if first.type == "ModuleNotFoundError":
            detail += ": a worker imports the loop from its module, which every node must have (Ray's runtime_env)"
        nodes = sorted({e.node_id or e.start_error.node_id for e in errors} - {""})  # type: ignore[union-attr]
        self.files.failure("worker_error", sorted(pending.index(w) for w in errors), nodes, detail, now, now)
        return LoopFailed(f"{detail}\n{first.traceback}".rstrip(), first.exception)

    def _adopt_ready(self, pending: list[Worker]) -> None:
        refs = [w.info_ref for w in pending if not w.resolved and w.info_ref is not None]
        if not refs:
            return
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        for w in pending:
            if w.info_ref in done:
                w.resolved = True
                try:
                    info: LoopInfo = ray.get(w.info_ref)
                except Exception as exc:  # noqa: BLE001 - it died starting: dropped
                    w.info_ref, w.start_error = None, died_starting(exc)
                    continue
                if info.load_error is not None:  # up, but the loop does not load there
                    w.info_ref, w.start_error = None, dataclasses.replace(info.load_error, node_id=info.node_id)
                    _kill(w)
                    continue
                w.node_id, w.ip, w.pid = info.node_id, info.ip, info.pid
                w.heard = time.monotonic()
                if w not in self.spares:
                    self.spares.append(w)

    def _ready_spares(self, check: bool = False) -> list[Worker]:
        """Spares that are up; ``check``: each answers a ping now (one may have started on a
        node that was dying)."""
        self._adopt_ready(self.spares)
        for w in [w for w in self.spares if w.resolved and not w.node_id]:
            self.spares.remove(w)
            if w.start_error is not None and self._cannot_grow is None:
                self._cannot_grow = w.start_error.error
                logger.warning("a new worker could not start the training loop: %s", self._cannot_grow)
        ready = [w for w in self.spares if w.node_id]
        if check and ready:
            pings = [w.actor.ping.remote() for w in ready]
            done, _ = ray.wait(pings, num_returns=len(pings), timeout=PING_TIMEOUT_S)
            for w, ref in zip(list(ready), pings, strict=True):
                ok = ref in done
                if ok:
                    try:
                        ray.get(ref)
                    except Exception:  # noqa: BLE001
                        ok = False
                if not ok:
                    ready.remove(w)
                    self.spares.remove(w)
                    _kill(w)
        return ready

    # ------------------------------------------------------------------ forming
    def _places(self, workers: list[Worker]) -> list[Place]:
        assert self.store is not None
        self.generation += 1
        nodes: dict[str, list[int]] = {}
        for i, w in enumerate(workers):
            nodes.setdefault(w.node_id, []).append(i)
        node_order = list(nodes)
        places = []
        for i, w in enumerate(workers):
            on_node = nodes[w.node_id]
            peer = next(
                (
                    workers[(i + k) % len(workers)].actor
                    for k in range(1, len(workers))
                    if workers[(i + k) % len(workers)].node_id != w.node_id
                ),
                None,
            )
            places.append(
                Place(
                    self.generation,
                    i,
                    len(workers),
                    on_node.index(i),
                    len(on_node),
                    node_order.index(w.node_id),
                    self.store.address,
                    self.store.secret,
                    peer,
                )
            )
        return places

    def _enter(self, workers: list[Worker], restore: Restore | None) -> None:
        self.members = workers
        self.spares = [w for w in self.spares if w not in workers]
        index = restore.index if restore is not None else 0
        for w, place in zip(workers, self._places(workers), strict=True):
            entry = Entry(
                place,
                index,
                restore,
                self.job.name,
                self.job.trial_name,
                self.job.storage_dir,
                f"{self.job.name}-{self.generation}",
                self.job.datasets,
            )
            w.outcome, w.waiting, w.generation = None, False, place.generation
            w.run_ref = w.actor.run.remote(entry)
            w.entries += 1
        self.files.entered(self.generation, index, len(workers), restore.index if restore is not None else None)
        self._growth_asked = False

    def _restore_point(self) -> Restore | None:
        index = self.newest_ckpt
        if index == 0:
            if self.committed:
                c = self.committed[-1]
                return Restore(c["index"], [], c["path"], c["positions"])
            return None
        parts = [(r, self.holders.get((index, r), [])) for r in sorted(self.parts.get(index, ()))]
        storage = next((c["path"] for c in self.committed if c["index"] == index), None)
        return Restore(index, parts, storage, self.positions.get(index, []))

    # ------------------------------------------------------------------ the run
    def _train(self, restore: Restore | None) -> list[Any]:
        first = self._ready_spares()[: self.job.max_workers]
        self._enter(first, restore)
        self.files.started(
            len(first),
            len({w.node_id for w in first}),
            name=self.job.name,
            min_workers=self.job.min_workers,
            max_workers=self.job.max_workers,
            storage_dir=self.job.storage_dir,
        )
        while True:
            if (unwritable := self.files.fault()) is not None:
                # as ``elastic run``'s controller: a run that cannot record itself stops, failed
                raise LoopFailed(f"the run directory can no longer be written: {unwritable}")
            self._poll()
            lost = self._lost()
            if lost is not None:
                self._recover(lost)
                continue
            outcomes = [w.outcome for w in self.members]
            if all(o is not None for o in outcomes):
                kinds = {o.kind for o in outcomes if o is not None}
                if kinds == {"finished"}:
                    self._drain()
                    return [o.value for o in outcomes if o is not None]
                if kinds == {"exited"}:
                    self._drain()
                    self._grow()
                    continue
            self._maybe_ask_growth()
            time.sleep(TICK_S)

    def _poll(self, workers: list[Worker] | None = None) -> None:
        for w in self.members if workers is None else workers:
            if w.run_ref is not None and w.outcome is None:
                done, _ = ray.wait([w.run_ref], timeout=0)
                if done:
                    try:
                        w.outcome = ray.get(w.run_ref)
                    except Exception as exc:  # noqa: BLE001 - the actor is gone
                        w.outcome = EntryOutcome.lost(f"{type(exc).__name__}: {exc}")
            if w.poll_ref is None:
                w.poll_ref = w.actor.poll.remote()
            done, _ = ray.wait([w.poll_ref], timeout=0)
            if done:
                ref, w.poll_ref = w.poll_ref, None
                try:
                    reply: LoopPoll = ray.get(ref)
                except Exception:  # noqa: BLE001 - the actor is gone: its run says so
                    continue
                w.waiting = reply.waiting and reply.generation == w.generation  # not a stale answer
                w.heard = time.monotonic()
                w.rss.append(reply.rss)
                w.held.append(reply.held)
                self._absorb(w, reply)

    def _drain(self, timeout_s: float = 10.0) -> None:
        """Every report the live members made is in (their runs returned)."""
        for w in self.members:
            if w.outcome is not None and w.outcome.kind == "lost":
                continue
            try:
                if w.poll_ref is not None:
                    reply = ray.get(w.poll_ref, timeout=timeout_s)
                    self._absorb(w, reply)
                    w.poll_ref = None
                reply = ray.get(w.actor.poll.remote(), timeout=timeout_s)
                self._absorb(w, reply)
            except Exception:  # noqa: BLE001 - lost meanwhile
                w.poll_ref = None

    def _absorb(self, w: Worker, reply: LoopPoll) -> None:
        for rep in reply.reports:
            index, rank = rep.index, rep.rank
            self.reports[index][rank] = rep
            self.ledger.append(
                {"index": index, "rank": rank, "generation": rep.generation, "world": rep.world, "rows": rep.rows,
                 "ts": rep.ts}
            )  # fmt: skip
            if rep.checkpoint:
                self.parts.setdefault(index, set()).add(rank)
                peer = self._peer_of(rank)
                self.holders[(index, rank)] = [w.actor] + ([peer] if peer is not None else [])
            if len(self.reports[index]) == rep.world:
                self._step_done(index, rep.world)
        for up in reply.uploads:
            self._uploaded(up)

    def _peer_of(self, rank: int) -> Any:
        members = self.members
        me = members[rank] if rank < len(members) else None
        if me is None:
            return None
        for k in range(1, len(members)):
            other = members[(rank + k) % len(members)]
            if other.node_id != me.node_id:
                return other.actor
        return None

    def _step_done(self, index: int, world: int) -> None:
        for older in sorted(i for i in self.reports if i < index):
            # some rank's report of it was lost with that rank, but the group went on past it
            # (it was applied everywhere): it is a step too
            self._step_done(older, next(iter(self.reports[older].values())).world)
        reps = self.reports.pop(index)
        if index <= self.steps and not self.files.recovering():
            return
        self.steps = max(self.steps, index)
        metrics = reps[0].metrics if 0 in reps else {}
        self.metrics.append({**metrics, "_step": index, "_world": world})
        self.files.step(index, world, reps, peer=len({w.node_id for w in self.members}) > 1)
        newest = self._newest_before
        if newest is not None and self.files.first_step(world, newest - (index - 1)) is not None:
            self._newest_before = None  # it resumed after step index - 1
        self.job.callbacks.reported(index, [reps[r].metrics for r in sorted(reps)], index in self.parts)
        if index in self.parts:
            self.positions[index] = reps[min(self.parts[index])].positions
            if index > self.newest_ckpt:
                # every rank reported it (the step is done) and each part is in its rank's
                # memory and on a peer: older checkpoints are not restored from memory again
                self.newest_ckpt = index
                self._forget_before(index)
            self._try_commit(index)

    def _forget_before(self, index: int) -> None:
        """The members drop the checkpoint files they hold of reports before ``index``
        (their own and their peers' copies): a rank's memory holds one checkpoint, not all."""
        for i, r in [k for k in self.holders if k[0] < index]:
            del self.holders[(i, r)]
        for w in self.members:
            if w.outcome is None or w.outcome.kind != "lost":
                try:
                    w.actor.forget_before.remote(index)
                except Exception:  # noqa: BLE001 - gone: it holds nothing any more
                    pass

    def _uploaded(self, up: Upload) -> None:
        index = up.index
        if up.error is not None or up.manifest is None:
            if index not in self.settled:
                self.settled.add(index)
                self.files.not_committed(index, up.error or "no manifest")
                self.job.callbacks.checkpoint_settled(index, None)
            return
        self.manifests[index][up.rank] = up.manifest
        self._try_commit(index)

    def _try_commit(self, index: int) -> None:
        want = self.parts.get(index)
        if not want or index not in self.positions or set(self.manifests.get(index, {})) != want:
            return
        if index in self.settled:
            return
        manifest: dict[str, Any] = {}
        for rank in sorted(want):
            manifest.update(self.manifests[index][rank])
        metrics = next((m for m in self.metrics if m["_step"] == index), {})
        metrics = {k: v for k, v in metrics.items() if not k.startswith("_")}
        path = ckpts.commit(
            self.job.storage_dir, index, manifest, {"metrics": metrics, "positions": self.positions[index]}
        )
        self.committed.append({"index": index, "path": path, "metrics": metrics, "positions": self.positions[index]})
        self.settled.add(index)
        self.files.committed(index, path, manifest)
        self.job.callbacks.checkpoint_settled(index, path)
        self._prune()

    def _prune(self) -> None:
        keep_n = self.job.num_to_keep
        if keep_n is None or len(self.committed) <= keep_n:
            return
        ranked = list(self.committed)
        attr = self.job.score_attribute
        if attr:
            sign = 1 if self.job.score_order == "max" else -1
            ranked.sort(key=lambda c: (sign * float(c["metrics"].get(attr, float("-inf") * sign)), c["index"]))
            keep = ranked[-keep_n:]
        else:
            keep = ranked[-keep_n:]
        newest = self.committed[-1]
        if newest not in keep:  # the newest is always kept: a rerun resumes from it
            keep = keep[1:] + [newest]
        ckpts.prune(self.job.storage_dir, [c["index"] for c in keep])
        self.committed = [c for c in self.committed if c in keep]

    def _wait_uploads(self) -> None:
        deadline = time.monotonic() + UPLOAD_WAIT_S
        while time.monotonic() < deadline:
            missing = [i for i in self.parts if i in self.positions and i not in self.settled]
            alive = [w for w in self.members if not (w.outcome and w.outcome.kind == "lost")]
            if not missing or not alive:
                return
            for w in alive:
                try:
                    reply: LoopPoll = ray.get(w.actor.poll.remote(), timeout=PING_TIMEOUT_S * 5)
                except Exception as exc:  # noqa: BLE001 - lost: its parts cannot come
                    w.outcome = EntryOutcome.lost(f"{type(exc).__name__}: {exc}")
                    continue
                for up in reply.uploads:
                    self._uploaded(up)
            time.sleep(0.05)

    # ------------------------------------------------------------------ failures
    def _lost(self) -> str | None:
        """A cause when a member is lost, a survivor's collective failed, or a loop raised."""
        for w in self.members:
            o = w.outcome
            if o is not None and o.failed:
                return o.error
            if w.waiting:
                return "a collective failed"
        return None

    def _recover(self, cause: str) -> None:
        detected = time.monotonic()
        newest = max([self.steps] + [i for i in self.reports])
        old = list(self.members)
        for w in self.members:
            if w.outcome is None or w.outcome.kind != "lost":
                try:
                    w.actor.abort_step.remote(w.generation)  # every link: a loop may use any pair
                except Exception:  # noqa: BLE001 - gone
                    pass
        lost, survivors = self._census()
        errors = [o for w in survivors if (o := w.outcome) is not None and o.kind in ("error", "collective")]
        self.job.callbacks.exception(worker_exceptions(old, lost, cause))
        if not lost and errors and len(errors) == len(self.members):
            first = errors[0].failure
            assert first is not None
            if all(e.failure is not None and (e.failure.type, e.failure.error) == (first.type, first.error)
                   for e in errors):  # fmt: skip
                # the loop's own error: retrying would raise it again
                detail = f"{first.error} (raised by the training loop on every rank: not retried)"
                ranks, nodes = list(range(len(old))), sorted({w.node_id for w in old})
                self.files.failure("worker_error", ranks, nodes, detail, detected, detected)
                raise LoopFailed(
                    f"the training loop raised {first.error} on every rank\n{first.traceback}".rstrip(),
                    first.exception,
                )
        heard = [w.heard for w in lost if w.heard]
        failed_at = min(detected, max(heard)) if heard else detected
        timer = PhaseTimer(time.monotonic, detected, detected - failed_at)
        timer.mark("free_s")  # the survivors pulled out of their collectives, the lost ones found
        kind, ranks, nodes = self._diagnose(old, lost, survivors)
        detail = f"{cause}; {len(lost)} worker(s) lost, {len(survivors)} left, after step {self.steps}"
        self.files.failure(kind, ranks, nodes, detail, failed_at, detected)
        self._newest_before = max(newest, self._newest_before or 0)
        if self.job.max_failures != -1 and self.files.failures > self.job.max_failures:
            failure = errors[0].failure if errors else None
            trace = failure.traceback if failure is not None else ""  # a loop's error: where it was raised
            raise LoopFailed(
                f"{cause} (FailureConfig.max_failures={self.job.max_failures}: {self.files.failures} failures)"
                f"\n{trace}".rstrip(),
                exception_of(errors),
            )
        for w in lost:
            _kill(w)
        spares = self._ready_spares(check=True)
        need = self.job.min_workers - len(survivors)
        timer.mark("decide_s")
        if need > 0:
            deadline = time.monotonic() + START_TIMEOUT_S
            if len(spares) < need:
                self.spares.extend(self._spawn(need - len(spares)))
            while len(spares) < need and time.monotonic() < deadline:
                time.sleep(0.1)
                spares = self._ready_spares()
                if len(spares) + sum(1 for w in self.spares if not w.resolved) < need:
                    break  # the replacements could not start: waiting longer brings none
            if len(spares) < need:
                why = f" (a replacement could not start the training loop: {self._cannot_grow})"
                raise LoopFailed(
                    f"{cause}: fewer than ScalingConfig.num_workers' minimum ({self.job.min_workers}) left"
                    + (why if self._cannot_grow else "")
                )
        timer.mark("spawn_s")
        in_place = survivors and all(w.waiting and w.outcome is None for w in survivors)
        if in_place:
            # a step every survivor reported was applied everywhere (its all-reduce had every
            # rank): it is a step of the old size, written before the resize
            kept = {old.index(w) for w in survivors}
            for index in sorted(self.reports):
                if index in self.reports and kept <= set(self.reports[index]):
                    self._step_done(index, next(iter(self.reports[index].values())).world)
            places = self._places(survivors)
            self.members = survivors
            for w, place in zip(survivors, places, strict=True):
                w.actor.reform.remote(place)
                w.waiting, w.generation = False, place.generation
            self.files.entered(self.generation, self.steps, len(survivors), None)
            self.files.resize(len(old), len(survivors), kind, how="in place", step=self.steps)
        else:
            for w in survivors:
                if w.outcome is None:
                    w.actor.reform.remote(None)
            self._wait_runs(survivors)
            for w in survivors:
                w.poll_ref = None
            self.members = survivors
            self._drain()
            restore = self._restore_point()
            resumed = restore.index if restore is not None else 0
            self.steps = resumed
            self.reports.clear()
            group = survivors + spares[: max(0, self.job.max_workers - len(survivors))]
            self._enter(group, restore)
            if len(group) != len(old):  # a replacement at the same size: no resize, as elastic run writes none
                self.files.resize(len(old), len(group), kind, how="entered again", step=resumed)
        self.job.callbacks.flush()  # a report waiting for a commit the lost worker's part would have made
        timer.mark("configure_other_s")
        self.files.reformed(timer.rounded(), len(self.members))

    def _diagnose(
        self, old: list[Worker], lost: list[Worker], survivors: list[Worker]
    ) -> tuple[str, list[int], list[str]]:
        """The failure's ``cause`` (docs/outputs.md), its ranks and their nodes."""
        if lost:
            nodes = {w.node_id for w in lost if w.node_id}
            candidates = nodes - {w.node_id for w in survivors}  # a node with a live worker is not lost
            gone = self.raylets.dead(candidates, wait_s=NODE_PROBE_S) if candidates else set()
            kind = "node_lost" if gone else "actor_died"
            return kind, sorted(old.index(w) for w in lost), sorted(nodes)
        raised = [w for w in survivors if w.outcome and w.outcome.kind == "error"]
        if raised:
            return "worker_error", sorted(old.index(w) for w in raised), sorted({w.node_id for w in raised})
        failed = [w for w in survivors if w.waiting or (w.outcome and w.outcome.kind == "collective")]
        return "collective_timeout", sorted(old.index(w) for w in failed), sorted({w.node_id for w in failed})

    def _census(self) -> tuple[list[Worker], list[Worker]]:
        """Who is lost: a run gone with its actor, no answer to a ping, or a node whose raylet
        refuses connections (proof it is gone, at once: Ray's own word on the actor comes
        with its health checks, about a second later); the survivors are waited for until
        each is waiting in a held step or its run has returned."""
        members = [w for w in self.members if not (w.outcome and w.outcome.kind == "lost")]
        pending = {w.actor.ping.remote(): w for w in members}
        deadline = time.monotonic() + PING_TIMEOUT_S
        lost = [w for w in self.members if w not in members]
        alive: list[Worker] = []
        while pending:
            done, _ = ray.wait(list(pending), num_returns=len(pending), timeout=TICK_S)
            for ref in done:
                w = pending.pop(ref)
                try:
                    ray.get(ref)
                    alive.append(w)
                except Exception:  # noqa: BLE001 - its actor is gone
                    lost.append(w)
            if not pending:
                break
            if time.monotonic() >= deadline:  # silent: treated as lost
                lost.extend(pending.values())
                break
            gone = self.raylets.dead({w.node_id for w in pending.values() if w.node_id}, 0.0, refused_only=True)
            for ref, w in [(r, w) for r, w in pending.items() if w.node_id in gone]:
                del pending[ref]
                lost.append(w)
        lost.sort(key=self.members.index)
        alive.sort(key=self.members.index)
        settle = time.monotonic() + SETTLE_TIMEOUT_S
        while time.monotonic() < settle:
            self._poll(alive)
            if all(w.outcome is not None or w.waiting for w in alive):
                break
            time.sleep(TICK_S)
        stuck = [w for w in alive if w.outcome is None and not w.waiting]
        for w in stuck:
            logger.warning("worker pid %d neither left its step nor returned: treated as lost", w.pid)
        return lost + stuck, [w for w in alive if w not in stuck and not (w.outcome and w.outcome.kind == "lost")]

    def _wait_runs(self, workers: list[Worker]) -> None:
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        for w in workers:
            if w.outcome is not None:
                continue
            try:
                w.outcome = ray.get(w.run_ref, timeout=max(0.1, deadline - time.monotonic()))
            except Exception as exc:  # noqa: BLE001
                w.outcome = EntryOutcome.lost(f"{type(exc).__name__}: {exc}")

    # ------------------------------------------------------------------ growth
    def _maybe_ask_growth(self) -> None:
        if self._growth_asked or len(self.members) >= self.job.max_workers or self._cannot_grow:
            return  # (a worker that cannot load the loop: another one would not either)
        if len(self.spares) == 0:
            self.spares.extend(self._spawn(self.job.max_workers - len(self.members)))
        if self._ready_spares():
            for w in self.members:
                w.actor.request_stop.remote()
            self._growth_asked = True

    def _grow(self) -> None:
        restore = self._restore_point()
        self.reports.clear()
        spares = self._ready_spares(check=True)
        group = self.members + spares[: self.job.max_workers - len(self.members)]
        old = len(self.members)
        self.steps = restore.index if restore is not None else 0
        self._enter(group, restore)
        self.files.resize(old, len(group), "capacity returned", how="grown at a checkpoint", step=self.steps)

    # ------------------------------------------------------------------ end
    def _shutdown(self) -> None:
        for w in self.members + self.spares:
            _kill(w)
        if self.store is not None:
            self.store.close()


def _fits(resources: dict[str, float]) -> int:
    """How many workers of ``resources`` the cluster's nodes hold, each node on its own."""
    total = 0
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        have = node.get("Resources", {})
        total += int(
            min((have.get(k, 0.0) // v if v > 0 else 1 << 30) for k, v in resources.items()) if resources else 0
        )
    return total


_REMOTE = ray.remote(concurrency_groups={"control": 8})(LoopRank)  # type: ignore[call-overload]


def _kill(w: Worker) -> None:
    try:
        ray.kill(w.actor, no_restart=True)
    except Exception:  # noqa: BLE001 - already gone
        pass
