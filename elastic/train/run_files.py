"""The run files of a ``TorchTrainer`` run: ``events.jsonl`` and ``summary.json`` with the
kinds and fields ``elastic run`` writes (``docs/outputs.md``), where they apply to a user's
loop (``docs/train_api.md``). The writer is the built-in trainer's (``elastic.events``), and
so are the recovery records (``elastic.control.outages``) and their phases
(``elastic.control.timing``).

What a loop's run says, kind by kind:

- ``job_start``: ``dp`` (the first group's size), ``tp`` 1, ``pp`` 1, ``nodes``; also
  ``name``, ``min_workers``, ``max_workers``, ``storage_dir``.
- ``step``: one per ``report`` index every rank of the group reached: ``step`` (the index,
  from 1), ``dp`` = ``world_size`` (the group's size), ``tp`` 1, ``pp`` 1, ``grad_accum`` 1
  (the platform accumulates nothing for a user's loop), ``step_time_s`` (from the previous
  step of the same group, or from the group's start for its first), ``loss`` when rank 0
  reported a number under ``loss``, and ``metrics``: rank 0's reported metrics. There is no
  ``tokens_per_s``: a loop's tokens are not known to the platform. ``rows_per_s``: the rows
  the platform's loaders (``prepare_data_loader``, ``get_dataset_shard``) served on every
  rank since the previous step, over ``step_time_s``; absent when they served none (a loop
  with a loader of its own).
- ``checkpoint``: ``tier: memory`` when every rank of a report holding a checkpoint has it
  in memory (``peer``: whether a copy went to a rank on another node), with ``blocking_s``
  (the slowest rank's ``report`` call, peer copy included) and ``bytes``; ``tier: storage``
  with ``committed`` when its commit record is written (or not: ``error``), ``bytes``,
  ``duration_s`` from the step to the commit, and ``blocking_s`` 0 (the upload runs in the
  background).
- ``failure``: ``cause`` (``node_lost`` when a lost worker's raylet is gone too,
  ``actor_died``, ``collective_timeout`` when a collective failed with no worker lost, or
  ``worker_error``), ``ranks``, ``nodes``, ``detail``.
- ``resize``: ``old_dp``, ``new_dp``, ``grad_accum`` 1, ``reason`` (the failure's cause, or
  ``capacity returned`` for a grow-back), and ``how`` (``in place``, ``entered again`` or
  ``grown at a checkpoint``) and ``step``; its ``ts`` is the re-formation's, and it is
  written after the steps the old group finished (``resize``).
- ``restore``: ``step``, ``source`` (``memory``: the rank's own copy or a peer's;
  ``storage``), ``duration_s`` (the slowest rank's), written when the group that restored
  completes its first step.
- ``job_end``: ``status`` (``succeeded`` or ``failed``), ``steps``, ``reason`` when failed.

``summary.json`` is ``elastic.events.RunResult``: ``mean_tokens_per_s`` is null (not
measured), ``mean_rows_per_s`` the mean of the steps' ``rows_per_s`` (null: none measured),
``excluded_nodes`` empty; the ``recoveries`` breakdown has the phases the loop driver
times: ``detect_s``, ``free_s`` (pulling the survivors out of their collectives and finding
who is lost), ``decide_s``, ``spawn_s`` (waiting for a replacement when below ``min``),
``configure_other_s`` (re-forming in place, or collecting the survivors' runs and entering
the loop again) and ``first_step_s``.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from elastic.control.outages import Outages
from elastic.events import EventLog, Recovery, RunResult, write_summary

if TYPE_CHECKING:
    from elastic.train.loop_messages import LoopReport

TP = PP = GRAD_ACCUM = 1

logger = logging.getLogger(__name__)


class LoopRunFiles:
    """Writes one loop run's events and summary; keeps its recoveries and DP history."""

    def __init__(self, run_dir: str, clock: Callable[[], float] = time.monotonic):
        self.run_dir = run_dir
        self.events = EventLog(run_dir)
        self.clock = clock
        self.outages = Outages()
        self.dp_history: list[list[int]] = []
        self.losses: dict[int, float | None] = {}
        self.rows_per_s: list[float] = []  # the steps' ``rows_per_s``, where measured
        self.failures = 0
        self.checkpoint_failures: list[dict[str, Any]] = []
        self.dp = 0
        self._generation_start: dict[int, tuple[float, int | None]] = {}  # generation -> (unix ts, restore index)
        self._last_step: tuple[int, float] | None = None  # (generation, ts) of the last step event
        self._step_ts: dict[int, float] = {}  # step -> when it completed (a storage commit's duration)
        self._recovered_world: int | None = None  # the size the open outage closes at
        self._resize: tuple[float, dict[str, Any]] | None = None  # a resize not written yet (``resize``)

    @property
    def recoveries(self) -> list[Recovery]:
        return self.outages.closed

    def fault(self) -> str | None:
        """Why the event log can no longer be written (a full disk, the run directory removed):
        ``EventLog.fault``; None while it can."""
        return self.events.fault()

    def subscribe(self, listener: Callable[[dict[str, Any]], None]) -> None:
        self.events.subscribe(listener)

    # ------------------------------------------------------------------ the group
    def started(self, dp: int, nodes: int, **extra: Any) -> None:
        self.dp = dp
        self.events.emit("job_start", dp=dp, tp=TP, pp=PP, nodes=nodes, **extra)

    def entered(self, generation: int, step: int, world: int, restore_index: int | None) -> None:
        """A generation of ``world`` ranks starts at ``step`` (restored from ``restore_index``)."""
        self._generation_start[generation] = (time.time(), restore_index)
        if not self.dp_history or self.dp_history[-1][1] != world:
            self.dp_history.append([step, world])

    def resize(self, old_dp: int, new_dp: int, reason: str, **extra: Any) -> None:
        """The group re-formed at ``new_dp`` ranks now. The event is written just before the
        first step at the new size (or the next failure, or the end), with the time of the
        re-formation: a step the old group finished but whose reports came in after it (a
        held step completes its report once re-formed) is written before it."""
        self._flush_resize()
        self.dp = new_dp
        fields = dict(old_dp=old_dp, new_dp=new_dp, grad_accum=GRAD_ACCUM, reason=reason, **extra)
        self._resize = (time.time(), fields)

    def _flush_resize(self, world: int | None = None) -> None:
        if self._resize is not None and (world is None or world == self._resize[1]["new_dp"]):
            ts, fields = self._resize
            self._resize = None
            self.events.emit("resize", ts=ts, **fields)

    # ------------------------------------------------------------------ steps
    def step(self, index: int, world: int, reps: dict[int, LoopReport], peer: bool = False) -> dict[str, Any]:
        """A report index every rank reached: its ``step`` event (after a ``restore`` when
        it is the first of a group that restored, and before the memory checkpoint's);
        ``peer``: the group spans nodes, so each checkpoint part has a copy on another."""
        self._flush_resize(world)
        ts = max(r.ts for r in reps.values())
        generation = max(r.generation for r in reps.values())
        started, restore_index = self._generation_start.get(generation, (ts, None))
        if self._last_step is not None and self._last_step[0] == generation:
            since = self._last_step[1]
        else:
            since = started
            self._restored(restore_index, reps, started)
        metrics = reps[min(reps)].metrics if reps else {}
        fields: dict[str, Any] = {
            "step": index,
            "dp": world,
            "tp": TP,
            "pp": PP,
            "grad_accum": GRAD_ACCUM,
            "world_size": world,
            "step_time_s": max(0.0, ts - since),
        }
        served = [r.rows_served for r in reps.values() if r.rows_served is not None]
        if sum(served) > 0 and ts > since:
            fields["rows_per_s"] = sum(served) / (ts - since)
            self.rows_per_s.append(fields["rows_per_s"])
        loss = metrics.get("loss")
        if isinstance(loss, (int, float)) and not isinstance(loss, bool):
            fields["loss"] = float(loss)  # a NaN is written as null
            self.losses[index] = float(loss) if math.isfinite(loss) else None
        fields["metrics"] = _json_safe(metrics)
        event = self.events.emit("step", ts=ts, **fields)
        self._last_step = (generation, ts)
        self._step_ts[index] = ts
        holders = [r for r in reps.values() if r.checkpoint]
        if holders:
            self.events.emit(
                "checkpoint",
                ts=ts,
                step=index,
                tier="memory",
                blocking_s=max(r.blocking_s for r in holders),
                duration_s=max(r.blocking_s for r in holders),
                bytes=sum(r.bytes for r in holders),
                peer=peer,
            )
        return event

    def _restored(self, restore_index: int | None, reps: dict[int, LoopReport], started: float) -> None:
        done = [r.restored for r in reps.values() if r.restored is not None]
        if restore_index is None or not done:
            return
        source = "storage" if any(d.source == "storage" for d in done) else "memory"
        duration = max(d.duration_s for d in done)
        self.events.emit("restore", ts=started + duration, step=restore_index, source=source, duration_s=duration)

    # ------------------------------------------------------------------ checkpoints in storage
    def committed(self, index: int, uri: str, manifest: dict[str, dict[str, Any]]) -> None:
        self._storage_event(index, sum(int(f.get("size", 0)) for f in manifest.values()), committed=True, uri=uri)

    def not_committed(self, index: int, cause: str) -> None:
        self.checkpoint_failures.append({"step": index, "cause": cause})
        self._storage_event(index, 0, committed=False, error=cause)

    def _storage_event(self, index: int, size: int, **fields: Any) -> None:
        """The ``checkpoint`` event of a storage commit (the upload runs beside the loop: 0 s blocking)."""
        self.events.emit(
            "checkpoint",
            step=index,
            tier="storage",
            blocking_s=0.0,
            duration_s=max(0.0, time.time() - self._step_ts.get(index, time.time())),
            bytes=size,
            **fields,
        )

    # ------------------------------------------------------------------ failures
    def failure(self, cause: str, ranks: list[int], nodes: list[str], detail: str, failed_at: float,
                detected_at: float) -> None:  # fmt: skip
        self._flush_resize()
        self.failures += 1
        self.outages.failed(cause, failed_at, detected_at)
        self.events.emit("failure", cause=cause, ranks=ranks, nodes=nodes, detail=detail)

    def reformed(self, breakdown: dict[str, float], world: int) -> None:
        """The group re-formed at ``world`` ranks; the outage closes at its first step."""
        self.outages.reformed(breakdown, self.clock())
        self._recovered_world = world

    def recovering(self) -> bool:
        return self.outages.is_open

    def first_step(self, world: int, lost_steps: int) -> Recovery | None:
        """A step at ``world`` ranks completed: it closes the open outage when the group
        re-formed at that size."""
        if self._recovered_world is None or world != self._recovered_world:
            return None
        self.outages.lost(lost_steps)
        closed = self.outages.first_step(self.clock())
        if closed is not None:
            self._recovered_world = None
        return closed

    # ------------------------------------------------------------------ the end
    def end(self, status: str, steps: int, wall_s: float, reason: str | None = None) -> RunResult:
        self._flush_resize()
        fields: dict[str, Any] = {"status": status, "steps": steps}
        if reason:
            fields["reason"] = reason
        self.events.emit("job_end", **fields)
        result = RunResult(
            status=status,
            steps=steps,
            final_loss=self.losses.get(steps),
            wall_s=wall_s,
            mean_tokens_per_s=None,  # a loop's tokens are not known to the platform: not measured
            mean_rows_per_s=sum(self.rows_per_s) / len(self.rows_per_s) if self.rows_per_s else None,
            failures=self.failures,
            dp_history=self.dp_history,
            recoveries=self.recoveries,
            checkpoint_failures=self.checkpoint_failures,
        )
        try:
            write_summary(self.run_dir, result)
        except OSError as exc:
            if self.fault() is None:  # the event log still writes: a summary the run cannot do without
                raise
            # the run failed for it already (its job_end names the cause): one line, no traceback
            logger.warning("summary.json not written: %s", exc.strerror or exc)
        return result

    def close(self) -> None:
        self.events.close()


def _json_safe(value: Any) -> Any:
    """A reported value as JSON holds it: a non-finite float as null, an unknown object as its text."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return str(value)
