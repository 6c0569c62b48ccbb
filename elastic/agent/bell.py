"""A doorbell for a thread blocked in ``ray.wait`` (agents and aggregators).

``ray.wait`` cannot be interrupted, so a thread that waits on many calls would see a call
issued meanwhile (a command's) only at its next timeout. The doorbell is a call to the
actor's own ``bell`` method, kept in every wait: it returns when ``ring`` is called, which
ends the wait at once.
"""

from __future__ import annotations

import threading
from typing import Any

import ray

BELL_TIMEOUT_S = 30.0  # an unrung bell returns after this anyway (and is asked again)


class Doorbell:
    def __init__(self, actor: Any = None):
        self.actor = actor  # the actor's own handle, with a ``bell`` method calling ``answer``; None: no Ray wait
        self._ref: Any = None
        self._rung = threading.Event()

    def wait(self, refs: list[Any], timeout_s: float) -> list[Any]:
        """``ray.wait`` on ``refs`` and the bell: the refs that are ready (all of them that are)."""
        if self.actor is not None and self._ref is None:
            self._ref = self.actor.bell.remote()
        bell = self._ref
        watch = refs + ([bell] if bell is not None else [])
        if not watch:
            self.answer(timeout_s)
            return []
        ready, _ = ray.wait(watch, num_returns=1, timeout=timeout_s)
        if ready and refs:  # every other answer that is in, in the same call
            ready, _ = ray.wait(watch, num_returns=len(watch), timeout=0)
        if bell is not None and bell in ready:
            self._ref = None
            return [r for r in ready if r != bell]
        return ready

    def ring(self) -> None:
        self._rung.set()

    def answer(self, timeout_s: float = BELL_TIMEOUT_S) -> bool:
        """The ``bell`` method's body: back when rung (or after ``timeout_s``)."""
        rang = self._rung.wait(timeout_s)
        self._rung.clear()
        return rang
