"""What hears a ``TorchTrainer`` run in the driver: ``RunConfig.callbacks``, the live
progress line and TensorBoard (``docs/train_api.md``).

``RunConfig.callbacks`` takes, in any mix:

- Ray Train V2's ``UserCallback`` interface (``ray.train.UserCallback``, or any object
  defining either method): ``after_report(run_context, metrics, checkpoint)`` once per
  step, in step order, with every rank's reported metrics (``metrics[i]`` is rank i's) and,
  when the report held a checkpoint, that checkpoint once it is committed in storage (None
  when it could not be, or was cut off by a recovery before it was);
  ``after_exception(run_context, worker_exceptions)`` when workers failed: world rank -> the
  loop's exception, or a ``RuntimeError`` saying why the worker is lost.
- The platform's own ``elastic.control.callbacks.Callback`` (the W&B and MLflow trackers of
  ``elastic/report/trackers.py``): ``after_event`` hears every ``events.jsonl`` event, and
  ``close`` is called at the end (``after_step`` and ``before_reconfigure`` belong to the
  built-in trainer's worker group and are not called).

An object with none of these methods is refused before any actor starts
(``TrainConfigError`` naming ``RunConfig.callbacks[i]``). A callback's exception is logged
and the run goes on.

The progress line is ``elastic.progress.ProgressDisplay`` on stdout, as ``elastic run
--progress`` shows it (at most one line a second when stdout is not a terminal);
``RunConfig(verbose=0)`` turns it off. TensorBoard: the events' scalars, the reported
metrics among them (``report/<name>``), go to ``storage_path/name/tensorboard`` (the local
run directory) whenever ``tensorboardX`` is installed (Ray Tune installs it), through the
built-in trainer's writer (``elastic/report/tracking.py``).
"""

from __future__ import annotations

import importlib.util
import logging
import uuid
from dataclasses import dataclass, field
from typing import Any

from elastic.train.checkpoint import Checkpoint
from elastic.train.config import TrainConfigError

logger = logging.getLogger(__name__)

RAY_HOOKS = ("after_report", "after_exception")
EVENT_HOOKS = ("after_event", "close")


@dataclass
class RunContext:
    """What Ray Train's ``TrainRunContext`` holds, for ``UserCallback`` methods."""

    run_config: Any
    train_loop_config: dict[str, Any] | None
    scaling_config: Any
    dataset_config: Any = None
    backend_config: Any = None
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex)

    def get_run_config(self) -> Any:
        return self.run_config


def check_callbacks(callbacks: list[Any]) -> None:
    """Each callback defines at least one hook this platform calls."""
    for i, cb in enumerate(callbacks):
        if not any(callable(getattr(cb, name, None)) for name in RAY_HOOKS + EVENT_HOOKS):
            raise TrainConfigError(
                f"RunConfig.callbacks[{i}]: {type(cb).__name__} defines none of "
                f"{', '.join(RAY_HOOKS + EVENT_HOOKS)} (a ray.train.UserCallback or an "
                "elastic.control.callbacks.Callback)"
            )


class LoopCallbacks:
    """Every listener of one run; the driver tells it of steps, commits and failures."""

    def __init__(
        self,
        callbacks: list[Any] | None = None,
        context: RunContext | None = None,
        progress: bool = False,
        tensorboard_dir: str | None = None,
    ):
        self.callbacks = list(callbacks or [])
        self.context = context
        self.progress = progress
        self.tensorboard_dir = tensorboard_dir
        self.tensorboard: Any = None
        self._queue: list[dict[str, Any]] = []  # steps whose after_report waits, in order
        self._committed: dict[int, str | None] = {}  # index -> path (None: not committed)

    def attach(self, files: Any) -> None:
        """Subscribe the event listeners to the run's ``LoopRunFiles``."""
        if self.progress:
            from elastic.progress import ProgressDisplay

            files.subscribe(ProgressDisplay(None, every_s=1.0))
        if self.tensorboard_dir is not None and importlib.util.find_spec("tensorboardX") is not None:
            from elastic.report.tracking import start_tensorboard

            self.tensorboard = start_tensorboard(self.tensorboard_dir, "")
            if self.tensorboard is not None:
                files.subscribe(self.tensorboard)
        for cb in self.callbacks:
            hook = getattr(cb, "after_event", None)
            if callable(hook):
                files.subscribe(_guarded(hook, cb))

    # ------------------------------------------------------------------ steps
    def reported(self, index: int, metrics: list[dict[str, Any]], has_checkpoint: bool) -> None:
        if not any(callable(getattr(cb, "after_report", None)) for cb in self.callbacks):
            return
        self._queue.append({"index": index, "metrics": metrics, "checkpoint": has_checkpoint})
        self._deliver()

    def checkpoint_settled(self, index: int, path: str | None) -> None:
        self._committed[index] = path
        self._deliver()

    def flush(self) -> None:
        """Deliver every waiting step; a checkpoint not committed by now is passed as None."""
        self._deliver(final=True)

    def _deliver(self, final: bool = False) -> None:
        while self._queue:
            head = self._queue[0]
            path = None
            if head["checkpoint"]:
                if head["index"] not in self._committed and not final:
                    return  # its commit is still to come
                path = self._committed.get(head["index"])
            self._queue.pop(0)
            checkpoint = Checkpoint(path) if path is not None else None
            for cb in self.callbacks:
                hook = getattr(cb, "after_report", None)
                if callable(hook):
                    _call(cb, hook, run_context=self.context, metrics=head["metrics"], checkpoint=checkpoint)

    # ------------------------------------------------------------------ failures and the end
    def exception(self, worker_exceptions: dict[int, BaseException]) -> None:
        if not worker_exceptions:
            return
        for cb in self.callbacks:
            hook = getattr(cb, "after_exception", None)
            if callable(hook):
                _call(cb, hook, run_context=self.context, worker_exceptions=worker_exceptions)

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard = None
        for cb in self.callbacks:
            hook = getattr(cb, "close", None)
            if callable(hook):
                _call(cb, hook)


def _call(cb: Any, hook: Any, **kwargs: Any) -> None:
    try:
        hook(**kwargs)
    except Exception:  # a callback's bug never ends the run
        logger.warning("RunConfig.callbacks: %s.%s raised", type(cb).__name__, hook.__name__, exc_info=True)


def _guarded(hook: Any, cb: Any) -> Any:
    def listener(event: dict[str, Any]) -> None:
        _call(cb, hook, event=event)

    return listener
