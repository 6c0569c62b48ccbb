"""Storage tier, worker side: each rank writes its part of a memory-tier snapshot to storage.

Every ``checkpoint.every_steps`` steps (and at the last step, so a finished run can be
extended with ``--resume``) :class:`StorageUploader` writes this rank's share of the memory
tier's snapshot of that step with the collective-free :func:`storage.write_rank_shard`:

- ``checkpoint.async: true``: the write runs on a background thread. The training loop only
  pays for *starting* the CPU copy (which the memory tier makes anyway); the copy itself
  overlaps the next forward/backward. The snapshot buffer is leased from the memory tier
  so its double buffer cannot reuse it mid-upload. Training never waits for storage, and a
  storage outage past the retry deadline only costs that checkpoint (reported at once:
  a warning, its event and ``summary.json``'s ``checkpoint_failures``). The final
  checkpoint is never skipped and always waited for: a job whose final checkpoint is not
  committed ends failed (DESIGN §10).
- ``checkpoint.async: false``: copy and write inline, the baseline the benchmark measures.

Each rank writes only what it owns (see :func:`owned_paths`), so a checkpoint holds every
byte once whatever the layout. Results travel to the controller through the worker's
results queue (drained by ``poll``); :mod:`elastic.checkpoint.committer` commits them.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from elastic.messages import ReportSink, UploadReport
from storage import CheckpointStore, RetryPolicy, primary_replica, redact, redact_uri, write_rank_shard

log = logging.getLogger(__name__)

SEP = "/"  # the memory tier's path separator (module FQNs already contain dots)
EXCLUDED = frozenset({"app/optim/param_groups"})  # per pipeline stage; rebuilt on load (restore.py)
GLOBAL_PREFIXES = ("train/", "app/scheduler/")  # identical on every rank: rank 0 writes them
MAX_QUEUED = 2  # saves waiting behind a running upload; more are skipped (and reported)
LEASE_POLL_S = 0.002
LEASE_TIMEOUT_S = 120.0


# ----------------------------------------------------------------------------- settings


def storage_settings(options: dict[str, Any] | None) -> tuple[dict[str, Any], RetryPolicy]:
    """Split ``checkpoint.storage_options`` into fsspec options and our retry policy.

    ``retry`` (RetryPolicy fields, e.g. ``{deadline_s: 60}``) is ours and must not reach fsspec.
    """
    opts = dict(options or {})
    retry = opts.pop("retry", None) or {}
    return opts, RetryPolicy(**retry)


def open_store(uri: str, options: dict[str, Any] | None) -> CheckpointStore:
    opts, policy = storage_settings(options)
    return CheckpointStore(uri, storage_options=opts, retry=policy)


def scrub(text: Any, options: dict[str, Any] | None = None) -> str:
    """``text`` with URI user info and every credential value of ``options`` masked.

    Error messages from storage clients may quote URIs or request parameters; anything
    that leaves this process (events, results, logs) goes through here first.
    """
    import os

    out = redact_uri(str(text))
    secrets = list(_secret_values(options or {}, redact(options or {})))
    secrets += [os.environ.get(k, "") for k in ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")]
    for value in secrets:
        if value and len(value) >= 4:
            out = out.replace(value, "***")
    return out


def _secret_values(orig: Any, red: Any) -> Iterator[str]:
    if isinstance(orig, dict):
        for k, v in orig.items():
            if red.get(k) == "***" and isinstance(v, str):
                yield v
            else:
                yield from _secret_values(v, red.get(k))
    elif isinstance(orig, (list, tuple)):
        for a, b in zip(orig, red):
            yield from _secret_values(a, b)


# ----------------------------------------------------------------------------- ownership


def walk_state(state: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """``(path, leaf)`` of a nested state dict, with the memory tier's ``a/b/fqn`` paths."""
    for key, value in state.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            yield from walk_state(value, path + SEP)
        else:
            yield path, value


def owned_paths(state: dict[str, Any], coords: Any, rank: int) -> frozenset[str]:
    """The snapshot paths this rank writes, so that every byte is written exactly once.

    - DTensor shards: the primary replica of the box; a DTensor whose mesh has no
      dimension across DP (``dp``, or the flattened ``dp_ep_cp`` / ``dp_cp`` of EP and CP
      layouts; TP under DDP) is replicated over DP, so DP rank 0 as well.
    - plain tensors and per-parameter optimizer objects (replicated over DP and TP, distinct
      per pipeline stage): the (dp 0, tp 0) rank of each stage.
    - ``train/*`` and the LR scheduler (the same on every rank): global rank 0.
    - optimizer ``param_groups`` name each stage's own parameters, so two stages would
      collide under one name: not written at all (rebuilt on load, see ``restore.py``).
    """
    from torch.distributed.tensor import DTensor

    from elastic.parallel.dims import spans_dp

    owned = set()
    for path, value in walk_state(state):
        if path in EXCLUDED:
            continue
        if isinstance(value, DTensor):
            names = value.device_mesh.mesh_dim_names or ()
            mine = primary_replica(value) and (any(spans_dp(n) for n in names) or coords.dp_rank == 0)
        elif path.startswith(GLOBAL_PREFIXES):
            mine = rank == 0
        else:  # the same on every EP and CP rank of a stage too
            mine = coords.dp_rank == coords.tp_rank == coords.ep_rank == coords.cp_rank == 0
        if mine:
            owned.add(path)
    return frozenset(owned)


# ----------------------------------------------------------------------------- uploader


@dataclass
class _Job:
    step: int
    owned: frozenset[str]
    blocking_s: float
    snap: Any = None  # the leased memory-tier Snapshot, once taken
    gone: str | None = None  # why the snapshot could not be leased


class StorageUploader:
    """One per configured worker; see the module docstring. Not shared across layouts."""

    _draining: threading.Thread | None = None  # a closed uploader's thread still writing

    def __init__(self, spec: Any, uri: str, rank: int, dims: Any, tier: Any, results: ReportSink, base_step: int):
        ck = spec.checkpoint
        self.every, self.last_step, self.async_ = ck.every_steps, spec.train.steps, ck.async_
        self.options = ck.storage_options
        self.store = open_store(uri, self.options)
        self.rank, self.coords, self.world = rank, dims.coords(rank), dims.world_size
        self.layout = {"dp": dims.dp, "tp": dims.tp, "pp": dims.pp, "zero": spec.parallel.zero}
        self.tier, self.results, self.base_step = tier, results, base_step
        self._cond = threading.Condition()
        self._jobs: collections.deque[_Job] = collections.deque()
        self._busy = False
        self._closed = False
        self._thread: threading.Thread | None = None

    @classmethod
    def create(
        cls, spec: Any, uri: str | None, rank: int, dims: Any, tier: Any, results: ReportSink, base_step: int
    ) -> StorageUploader | None:
        if not spec.checkpoint.every_steps:
            return None
        uri = uri or spec.checkpoint.uri
        if not uri:
            log.warning(
                "checkpoint.every_steps=%d but no checkpoint URI is known: storage tier off",
                spec.checkpoint.every_steps,
            )
            return None
        return cls(spec, uri, rank, dims, tier, results, base_step)

    def due(self, step: int) -> bool:
        return step % self.every == 0 or step == self.last_step

    # ----- training thread
    def save(self, step: int, state: dict[str, Any], snapshot_blocking_s: float) -> None:
        """Write (sync) or queue (async) this rank's part of the memory snapshot of ``step``.

        ``state`` is the live nested state the snapshot was started from (its DTensors tell
        who owns what); ``snapshot_blocking_s`` is what starting that snapshot cost.
        """
        t0 = time.perf_counter()
        job = _Job(step, owned_paths(state, self.coords, self.rank), snapshot_blocking_s)
        if not self.async_:
            self.tier.wait()
            job.snap = self.tier.get(self.rank, step, lease=True)
            self._write(job, blocking_from=t0)
            return
        job.blocking_s += time.perf_counter() - t0
        final = step == self.last_step
        with self._cond:
            if len(self._jobs) > MAX_QUEUED and not final:  # the final checkpoint is never skipped
                self._report(job, None, f"skipped: {len(self._jobs)} earlier uploads still pending", 0.0, time.time())
                return
            self._jobs.append(job)
            self._cond.notify_all()
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=f"ckpt-upload-r{self.rank}", daemon=True)
            self._thread.start()
        if final:  # the job is over: no training left to overlap with
            waited = self.flush(self.store.retry.deadline_s + 60)
            log.info("final checkpoint step %d: waited %.3fs for the upload", step, waited)

    def secure(self, step: int) -> None:
        """Lease queued saves' snapshots older than ``step`` (complete by now), in case the upload
        thread has not yet: the memory tier may recycle a buffer two snapshots later."""
        with self._cond:
            for job in self._jobs:
                if job.snap is None and job.gone is None and job.step < step:
                    self._try_lease(job, final=True)

    def flush(self, timeout: float) -> float:
        """Wait (bounded) until every queued upload has finished; returns the seconds waited."""
        t0 = time.perf_counter()
        with self._cond:
            self._cond.wait_for(lambda: not self._jobs and not self._busy, timeout=timeout)
        return time.perf_counter() - t0

    def close(self) -> None:
        """Drop queued uploads (their step was interrupted by a resize) and stop the thread.

        An upload in flight finishes in the background but its result is discarded: the
        committer only ever sees steps whose every rank reported under one layout.
        """
        with self._cond:
            self._closed = True
            if self._thread is not None and self._thread.is_alive():
                StorageUploader._draining = self._thread
            for job in list(self._jobs)[1 if self._busy else 0 :]:
                self._jobs.remove(job)
                if job.snap is not None:
                    self.tier.release(job.snap)
            self._cond.notify_all()

    # ----- upload thread
    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._jobs or self._closed)
                if not self._jobs:
                    return
                job, self._busy = self._jobs[0], True
            deadline = time.monotonic() + LEASE_TIMEOUT_S
            while True:
                with self._cond:
                    if job.snap is None and job.gone is None:
                        self._try_lease(job, final=time.monotonic() > deadline)
                    if job.snap is not None or job.gone is not None or self._closed:
                        break
                time.sleep(LEASE_POLL_S)
            if self._closed:  # interrupted by a resize: nobody will commit this step
                if job.snap is not None:
                    self.tier.release(job.snap)
            elif job.snap is not None:
                self._write(job)
            else:
                self._report(job, None, job.gone, 0.0, time.time())
            with self._cond:
                if self._jobs and self._jobs[0] is job:
                    self._jobs.popleft()
                self._busy = False
                self._cond.notify_all()

    def _try_lease(self, job: _Job, final: bool) -> None:
        try:
            job.snap = self.tier.get(self.rank, job.step, lease=True)
        except KeyError:
            if final:
                job.gone = f"memory snapshot of step {job.step} is no longer held (copy failed or recycled)"

    def _write(self, job: _Job, blocking_from: float | None = None) -> None:
        draining = StorageUploader._draining  # never write a file the old layout is still writing
        if draining is not None and draining is not threading.current_thread():
            draining.join(self.store.retry.deadline_s + 60)
        started_at, t0 = time.time(), time.perf_counter()
        res, error, replay = None, None, False
        try:
            snap = job.snap
            replay = self.store.read_marker(job.step) is not None  # never overwrite a committed step
            flat = {k: v for part in (snap.tensors, snap.objects) for k, v in part.items() if k in job.owned}
            if not replay:
                res = write_rank_shard(self.store, job.step, flat, self.rank)
        except Exception as exc:  # noqa: BLE001 - reported as a failed checkpoint, training goes on
            error = scrub(f"{type(exc).__name__}: {exc}", self.options)
            log.error("rank %d: upload of checkpoint step %d failed: %s", self.rank, job.step, error)
        finally:
            self.tier.release(job.snap)
        if blocking_from is not None:  # synchronous: the whole write held the training loop
            job.blocking_s += time.perf_counter() - blocking_from
        self._report(job, res, error, time.perf_counter() - t0, started_at, replay)

    def _report(
        self,
        job: _Job,
        res: Any,
        error: str | None,
        duration_s: float,
        started_at: float,
        already_committed: bool = False,
    ) -> None:
        result = UploadReport(
            step=job.step,
            rank=self.rank,
            gen=(self.base_step, self.world),
            layout=self.layout,
            result=res.to_dict() if res is not None else None,
            error=error,
            blocking_s=job.blocking_s,
            duration_s=duration_s,
            started_at=started_at,
            bytes=res.bytes_written if res is not None else 0,
            already_committed=already_committed,
        )
        with self._cond:
            if not self._closed:
                self.results.append(result)
