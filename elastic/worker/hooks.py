"""The seam through which a test (or a user's tool) acts inside a worker's step.

The worker calls a ``StepHook`` at fixed points of every step, if one was given to the job
(``ElasticTrainer(step_hook=...)``). Fault injection (``elastic/faults/``) is
one; production code never imports it: the hook object travels to the workers pickled.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class StepHook(Protocol):
    def attach(self, stop: threading.Event, beat: Callable[[], None]) -> None:
        """Called once in the worker: its "stop at the next boundary" flag and its heartbeat."""

    def pending(self, step: int, rank: int) -> bool:
        """Will ``before_step`` act at this step? (The worker then settles its snapshot first.)"""

    def before_step(self, step: int, rank: int, engine: Any) -> None:
        """Called after the step's batch is read, before its forward pass."""

    def before_join(self, generation: int, rank: int) -> None:
        """Called as the rank is about to join generation ``generation`` of the group."""
