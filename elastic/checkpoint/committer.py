"""Storage tier, controller side: commit a step once every rank of its group wrote its part.

Ranks send ``UploadReport``s (``elastic/messages.py``, written by
:mod:`elastic.checkpoint.storage_tier`) through ``poll``; the controller owns one
:class:`CheckpointCommitter` and hands them to it. Results are
grouped by ``(gen, step)`` where ``gen = [base step, world size]`` identifies the
configuration that produced them: a step commits only when ranks ``0..world-1`` of one
configuration all reported, so parts written under two layouts are never mixed.

A re-formation (a failure's recovery, a resize, a drain) or the job's end cuts off the
uploads still queued or in flight in the generation that ends (``StorageUploader.close``).
The controller says so (``cut_off``); a due step of that generation that is not complete
then is recorded as not committed once it can no longer complete: when a later step's
commit is submitted (every rank has written past it), or at ``close``. A partial group
superseded that way is recorded too, with the ranks that had uploaded it. So no storage
checkpoint that was due is lost silently.

The commit (``commit_checkpoint``: metadata, manifest, marker) and the retention pass run on
one background thread, in step order, so the controller's loop never waits for storage.
Each step ends in exactly one ``checkpoint`` event with ``tier: "storage"`` and
``committed`` true or false (with ``error``). :meth:`CheckpointCommitter.join` bounds the wait for
in-flight commits at the end of a job and before a restore from storage.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

from elastic.checkpoint.storage_tier import open_store, scrub
from elastic.messages import UploadReport
from storage import RankWriteResult, commit_checkpoint, redact_uri

log = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 300.0


class CheckpointCommitter:
    def __init__(self, spec: Any, uri: str, events: Any):
        self.uri, self.events = uri, events
        self.options = spec.checkpoint.storage_options
        self.keep = spec.checkpoint.keep
        # Recorded in every manifest: `elastic ckpt export` rebuilds the model from it, without the spec.
        self.model = spec.model.model_dump(mode="json")
        self._store = None
        self._groups: dict[tuple[int, int, int], dict[int, UploadReport]] = {}  # (base, world, step) -> rank -> report
        self._finished: set[tuple[int, int, int]] = set()  # groups already submitted
        self._queue: queue.Queue = queue.Queue()
        self._cond = threading.Condition()
        self._inflight = 0
        self._thread: threading.Thread | None = None
        self.failures: list[dict[str, Any]] = []  # {step, cause} of every storage checkpoint not committed
        self.every, self.last_step = spec.checkpoint.every_steps, spec.train.steps
        self._cut: dict[int, str] = {}  # due step -> what cut its uploads off (``cut_off``), until settled
        self._committed: set[int] = set()  # steps this job committed: a later skip of one is a replay

    @property
    def store(self):
        if self._store is None:
            self._store = open_store(self.uri, self.options)
        return self._store

    def add(self, rank: int, result: UploadReport) -> None:
        """One rank's upload report; submits the step once its group is complete."""
        base, world = result.gen
        step = result.step
        key = (base, world, step)
        if key in self._finished:
            return
        group = self._groups.setdefault(key, {})
        group[rank] = result
        if set(group) != set(range(world)):
            return
        del self._groups[key]
        self._finished.add(key)
        for earlier in [s for s in self._open() if s <= step]:  # every rank has written past them
            self._give_up(earlier)
        with self._cond:
            self._inflight += 1
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="ckpt-commit", daemon=True)
            self._thread.start()
        self._queue.put((step, world, group))

    def settled(self, step: int) -> bool:
        """Has every rank's upload of ``step`` arrived under one configuration (its commit
        then runs or has run), or was ``step`` recorded as not committed?"""
        with self._cond:
            if any(f["step"] == step for f in self.failures):
                return True
        return any(k[2] == step for k in self._finished)

    def cut_off(self, base: int, upto: int, why: str) -> None:
        """The generation that trained steps ``base + 1 .. upto`` ended (``why``: a
        re-formation, the job's end) and its ranks dropped their uploads still queued or in
        flight. Its due steps that are not settled yet are recorded as not committed once
        they can no longer complete (a report already on its way may still complete one)."""
        if not self.every:
            return
        due = list(range((base // self.every + 1) * self.every, upto + 1, self.every))
        if base < self.last_step <= upto and self.last_step % self.every:
            due.append(self.last_step)
        for step in due:
            if not self.settled(step):
                self._cut.setdefault(step, why)

    def dropped(self, step: int, cause: str) -> None:
        """A step's uploads were thrown away on purpose (an SDC check found corruption
        before they were verified): recorded as not committed now."""
        self._give_up(step, cause)

    def _open(self) -> list[int]:
        """Steps not committed yet that some rank uploaded, or whose uploads were cut off."""
        return sorted({k[2] for k in self._groups} | set(self._cut))

    def _give_up(self, step: int, why: str | None = None) -> None:
        """``step`` can no longer complete (a later or the same step's commit was submitted,
        or the job is over): recorded as not committed, unless it settled."""
        partial = [(k, self._groups.pop(k)) for k in [k for k in self._groups if k[2] == step]]
        cut = self._cut.pop(step, None)
        why = why or cut or "the other ranks' uploads were cut off or skipped"
        if self.settled(step):
            return  # committed (under this layout or another), or already recorded
        had = [f"ranks {sorted(group)} of {world} had uploaded it" for (_, world, _), group in partial]
        reports = [r for _, group in partial for r in group.values()]
        first = min((r.started_at for r in reports), default=time.time())
        fields = {"step": step, "tier": "storage", "blocking_s": max((r.blocking_s for r in reports), default=0.0)}
        self._not_committed(step, "; ".join([why, *had]), fields, time.time() - first)

    def join(self, timeout: float = JOIN_TIMEOUT_S) -> bool:
        """Wait (bounded) for every submitted commit; True when none is left in flight."""
        with self._cond:
            done = self._cond.wait_for(lambda: self._inflight == 0, timeout=timeout)
        if not done:
            log.warning("checkpoint commits still running after %.0fs; not waiting any longer", timeout)
        return done

    def close(self) -> None:
        """The job is over: the commit thread ends once the commits queued before finish (it
        is not waited for). Without this, each job run in a process left a thread behind.
        Steps that can no longer complete are recorded as not committed first."""
        for left in self._open():
            self._give_up(left)
        if self._thread is not None:
            self._queue.put(None)

    # ----- commit thread
    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            step, world, group = item
            try:
                self._commit(step, world, group)
            except Exception:  # noqa: BLE001 - never let the thread die with commits queued
                log.exception("checkpoint commit of step %d crashed", step)
            finally:
                with self._cond:
                    self._inflight -= 1
                    self._cond.notify_all()

    def _commit(self, step: int, world: int, group: dict[int, UploadReport]) -> None:
        results = [group[r] for r in range(world)]
        first = min(r.started_at for r in results)
        fields = {"step": step, "tier": "storage", "blocking_s": max(r.blocking_s for r in results)}
        if any(r.already_committed for r in results):
            self._kept_first(step, fields, time.time() - first)
            return
        errors = [f"rank {r.rank}: {r.error}" for r in results if r.error]
        if errors:
            self._not_committed(step, _distinct(errors), fields, time.time() - first)
            return
        try:
            if self.store.read_marker(step) is not None:  # never rewrite a committed step's metadata
                self._kept_first(step, fields, time.time() - first)
                return
            info = commit_checkpoint(
                self.store,
                step,
                [_write_result(r) for r in results],
                extra={"world": world, "layout": results[0].layout, "model": self.model},
            )
        except Exception as exc:  # noqa: BLE001 - storage down or parts missing: not committed
            self._not_committed(step, f"commit failed: {type(exc).__name__}: {exc}", fields, time.time() - first)
            return
        with self._cond:
            self._committed.add(step)
        self._emit(**fields, duration_s=time.time() - first, bytes=info.bytes, committed=True, uri=redact_uri(info.uri))
        try:
            report = self.store.prune(self.keep)
            if report.deleted or report.failed:
                log.info("retention: deleted steps %s, kept %s, failed %s", report.deleted, report.kept, report.failed)
        except Exception as exc:  # noqa: BLE001 - retention is best effort
            log.warning("pruning checkpoints failed: %s", scrub(exc, self.options))

    def _kept_first(self, step: int, fields: dict[str, Any], duration_s: float) -> None:
        """``step`` has a commit marker already, so its first commit is kept. A replay of a
        step this job committed (after a restore) is nothing to report. The final step
        committed by someone else (another run on ``checkpoint.uri``, or a damaged
        checkpoint a resume passed over) is: the stored step is not this run's final state,
        so it is recorded as not committed and the job fails (``final_failure``)."""
        with self._cond:
            ours = step in self._committed
        if ours or step != self.last_step:
            log.info("step %d is already committed (a replay after a restore); keeping the first commit", step)
            return
        why = (
            f"step {step} is already committed in storage, not by this job (another run on checkpoint.uri, or a "
            "damaged checkpoint a resume passed over): that commit is kept, and it is not this run's final state"
        )
        self._not_committed(step, why, fields, duration_s)

    def _not_committed(self, step: int, cause: str, fields: dict[str, Any], duration_s: float) -> str:
        """A storage checkpoint that failed: a warning on the console now, its event, and an
        entry of ``summary.json``'s ``checkpoint_failures``. Returns the cause as recorded."""
        cause = " ".join(scrub(cause, self.options).split())[:1000]
        log.warning("checkpoint of step %d NOT committed to storage: %s", step, cause)
        with self._cond:
            self.failures.append({"step": step, "cause": cause})
        self._emit(**fields, duration_s=duration_s, bytes=0, committed=False, error=cause)
        return cause

    def final_failure(self, step: int) -> str | None:
        """Why the final checkpoint, of ``step``, is not this run's in storage, or None when
        it is (waits for the commits in flight first; read back from storage, not from
        memory). Whatever the cause, it is in ``failures`` (``summary.json``'s
        ``checkpoint_failures``) and in a ``checkpoint`` event once this returns."""
        self.join()
        fields = {"step": step, "tier": "storage", "blocking_s": 0.0}
        try:
            marked = self.store.read_marker(step) is not None
        except Exception as exc:  # noqa: BLE001 - storage unreadable: the checkpoint cannot be trusted
            why = f"its commit marker cannot be read: {type(exc).__name__}: {exc}"
            return self._not_committed(step, why, fields, 0.0)
        with self._cond:
            ours = step in self._committed
            causes = [f["cause"] for f in self.failures if f["step"] == step]
        if marked and (ours or not causes):
            return None
        if causes:
            return causes[-1]
        return self._not_committed(step, "not every rank's upload of it arrived", fields, 0.0)

    def _emit(self, **fields: Any) -> None:
        try:
            self.events.emit("checkpoint", **fields)
        except Exception as exc:  # noqa: BLE001 - the event log may be closed when a failed job ends
            log.warning("could not record checkpoint event %s: %s", fields, exc)


def _distinct(errors: list[str]) -> str:
    """Ranks' errors as one cause: each distinct message once, with the ranks that hit it."""
    by_message: dict[str, list[str]] = {}
    for e in errors:
        rank, _, message = e.partition(": ")
        by_message.setdefault(message, []).append(rank.removeprefix("rank "))
    return "; ".join(f"rank{'s' if len(r) > 1 else ''} {','.join(r)}: {m}" for m, r in by_message.items())


def _write_result(report: UploadReport) -> RankWriteResult:
    """What a rank wrote, from a report without an error (one with neither is a worker bug)."""
    if report.result is None:
        raise RuntimeError(f"rank {report.rank}'s upload report has neither an error nor a result")
    return RankWriteResult.from_dict(report.result)
