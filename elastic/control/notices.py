"""Advance notices the controller acts on while training: a stop signal (``elastic/control/stop.py``)
and nodes that Ray drains (``elastic/control/drain.py``). Called by the controller's loop whenever it
is in ``Running``; returns the next state."""

from __future__ import annotations

from typing import Any

from elastic.control.states import State
from elastic.errors import WorkerFailure


def act(ctl: Any, state: State) -> State:
    signals = getattr(ctl, "stop_signals", None)
    if signals is not None and signals.requested:
        from elastic.control.stop import stop_at_boundary

        return stop_at_boundary(ctl)
    watch = ctl.__dict__.get("_drain_watch")
    if watch is None:
        from elastic.control.drain import DrainWatch

        watch = ctl.__dict__["_drain_watch"] = DrainWatch()
    try:
        return watch.act(ctl, state)
    except WorkerFailure as failure:  # lost while shrinking around a drained node: an ordinary recovery
        return ctl._recovering(failure)
