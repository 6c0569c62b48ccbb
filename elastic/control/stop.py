"""Graceful stop of a whole job on SIGINT or SIGTERM (``docs/outputs.md``, "Stopping a job").

* :class:`StopSignals` lives in the driver. Its handler only records the signal: the
  controller's loop acts on it at its next look (every poll interval while training).
  A second signal, or ``elastic.stop_grace_s`` passing before the step boundary is reached,
  raises :class:`StopNow` in the main thread: the job stops at once, without a checkpoint.
* with the first signal the controller stops every rank after the same step, the storage
  tier gets a committed, verified checkpoint of that step (unless one exists;
  :func:`checked_stop_checkpoint`), and the controller ends in :class:`Stopped`.
* the worker's half, writing the live step to the storage tier, is ``Trainer.save_live_step``.

Why our own SIGTERM handler: ``ray.init`` installs one in the driver that calls
``sys.exit(15)`` from whatever the main thread is doing. The ``SystemExit`` then unwinds
through Ray's native calls while Ray's C++ threads still run, and the process ends by
SIGABRT after a native stack dump, with no summary and no checkpoint. We replace it after
``ray.init`` and put back the previous handlers when the job is over.
"""

from __future__ import annotations

import _thread
import logging
import signal
import sys
import threading
import time
from typing import Any

log = logging.getLogger(__name__)

SIGNAL_NAMES: dict[int, str] = {signal.SIGINT: "SIGINT", signal.SIGTERM: "SIGTERM"}
CHECKPOINT_TIMEOUT_S = 300.0  # writing and committing the stop checkpoint (after the boundary)


class StopNow(BaseException):
    """Raised in the driver's main thread: stop at once, without a checkpoint.

    A ``BaseException`` (like ``KeyboardInterrupt``) so that no ``except Exception`` on the
    way swallows it.
    """

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def stop_now_in(exc: BaseException) -> StopNow | None:
    """The ``StopNow`` behind ``exc``: raised from the handler inside a Ray call, it comes
    out wrapped (Cython reports it as a ``SystemError`` caused by it)."""
    seen = 0
    cur: BaseException | None = exc
    while cur is not None and seen < 5:
        if isinstance(cur, StopNow):
            return cur
        cur = cur.__cause__ or cur.__context__
        seen += 1
    return None


class StopSignals:
    """SIGINT/SIGTERM handler of the driver, installed for the lifetime of one job."""

    def __init__(self, grace_s: float):
        self.grace_s = grace_s
        self.signum: int | None = None
        self.at: float | None = None  # monotonic time of the first signal
        self.second = False
        self.grace_expired = False
        self.boundary_reached = False  # past the step boundary: the grace no longer applies
        self.finished = False  # the job is over: further signals are ignored
        self._previous: dict[int, Any] = {}
        self._timer: threading.Timer | None = None

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def signal_name(self) -> str:
        if self.signum is None:
            return "None"  # no signal came
        return SIGNAL_NAMES.get(self.signum, str(self.signum))

    @property
    def exit_code(self) -> int:
        """128 + the signal number: 130 after SIGINT, 143 after SIGTERM."""
        return 128 + int(self.signum or signal.SIGTERM)

    def remaining_s(self) -> float:
        if self.at is None:
            return self.grace_s
        return max(0.0, self.grace_s - (time.monotonic() - self.at))

    def install(self) -> bool:
        """Install the handlers (main thread only); returns False where that is impossible."""
        if threading.current_thread() is not threading.main_thread():
            log.warning("not in the main thread: SIGINT/SIGTERM keep their handlers (no graceful stop)")
            return False
        for sig in SIGNAL_NAMES:
            self._previous[sig] = signal.signal(sig, self._handle)
        return True

    def job_over(self) -> None:
        """The job reached its end (any end): signals from now on are ignored. What follows
        (killing the actors, closing the group) is already the immediate stop a second
        signal would ask for, and a signal raised into it would lose the result."""
        self.finished = True
        if self._timer is not None:
            self._timer.cancel()

    def uninstall(self) -> None:
        self.job_over()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def past_boundary(self) -> None:
        self.boundary_reached = True
        if self._timer is not None:
            self._timer.cancel()

    # Runs in the main thread between two bytecodes: record, and raise only to stop at once.
    def _handle(self, signum: int, frame: Any) -> None:
        if self.finished:
            return
        if self.signum is None:
            self.signum, self.at = signum, time.monotonic()
            print(
                f"\n{SIGNAL_NAMES.get(signum, signum)}: stopping at the next step boundary and checkpointing "
                f"(within elastic.stop_grace_s={self.grace_s:g}s); signal again to stop at once",
                file=sys.stderr,
                flush=True,
            )
            self._timer = threading.Timer(self.grace_s, self._expire, args=(signum,))
            self._timer.daemon = True
            self._timer.start()
            return
        if self.grace_expired and not self.second:
            raise StopNow(f"the step boundary was not reached within elastic.stop_grace_s={self.grace_s:g}s")
        self.second = True
        raise StopNow(f"second signal ({SIGNAL_NAMES.get(signum, signum)}): stopped at once")

    def _expire(self, signum: int) -> None:  # timer thread: wake the main thread through the handler
        if self.finished or self.boundary_reached:
            return
        self.grace_expired = True
        _thread.interrupt_main(signal.Signals(signum))


# --------------------------------------------------------------------------- controller side


def checked_stop_checkpoint(committer: Any, step: int) -> tuple[int | None, str]:
    """After every rank wrote the live ``step`` (``WorkerGroupAPI.save_checkpoints``): wait
    for the commit and verify it. Returns (the checkpoint step, or None; the stop reason)."""
    committer.join(timeout=CHECKPOINT_TIMEOUT_S)
    try:
        store = committer.store
        if store.read_marker(step) is None:
            return None, f"the checkpoint of step {step} was not committed"
        damage = store.verify(step)
    except Exception as exc:  # noqa: BLE001 - storage unreadable: say so, the job still stops
        return None, f"the checkpoint of step {step} could not be checked: {exc}"
    if damage:
        return None, f"the checkpoint of step {step} failed verification: {damage[0]}"
    print(f"stopped at step {step}; checkpoint of step {step} committed and verified", file=sys.stderr, flush=True)
    return step, "stopped at a step boundary"


def exit_code_of(result: Any) -> int:
    """The exit code of a stopped job: 128 + its signal (130 SIGINT, 143 SIGTERM)."""
    name = (getattr(result, "stop", None) or {}).get("signal")
    codes = {v: 128 + int(k) for k, v in SIGNAL_NAMES.items()}
    return codes.get(str(name), 128 + int(signal.SIGTERM))
