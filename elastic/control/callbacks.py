"""Typed lifecycle callbacks of a job, called by the controller in the driver. Subclass
:class:`Callback` and override what you need; the controller calls every callback at each
point, in the order given (``ElasticTrainer(callbacks=[...])``), and refuses an object that
is not a ``Callback`` when the job is built. A subclass that defines a method named like a
hook that is none (``on_step``, ``on_reconfigure``, any ``on_*``, ``before_*`` or
``after_*`` not in :data:`HOOKS`) is refused where it is defined, with a ``TypeError``
naming the method and the real hooks, so a misspelt hook cannot be silently ignored. The
fault tool (``elastic/faults/``) is one; the W&B and MLflow trackers
(``elastic/report/trackers.py``) are others.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from elastic.control.worker_group.api import Member, WorkerGroupAPI


HOOKS = ("after_step", "after_event", "before_reconfigure", "close")  # what the controller calls
_HOOK_LIKE = ("on_", "before_", "after_")


class Callback:
    """Every hook is a no-op by default."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name in vars(cls):
            if name.startswith(_HOOK_LIKE) and name not in HOOKS and callable(vars(cls)[name]):
                raise TypeError(
                    f"{cls.__name__}.{name}: not a hook, the controller never calls it; "
                    f"the hooks are {', '.join(HOOKS)} (elastic/control/callbacks.py)"
                )

    def after_step(self, step: int, group: WorkerGroupAPI) -> None:
        """Step ``step`` was committed: every rank reported it."""

    def after_event(self, event: dict[str, Any]) -> None:
        """An event was written to ``events.jsonl`` (docs/outputs.md): every kind, in order,
        from the driver's threads. The experiment trackers (``elastic/report/trackers.py``)
        log from here; keep it quick, it runs where the event is emitted."""

    def before_reconfigure(self, recovery: int, group: WorkerGroupAPI, members: Sequence[Member]) -> None:
        """Recovery number ``recovery`` chose ``members`` (in new rank order) and is about to
        re-form them."""

    def close(self) -> None:
        """The job is over (whatever its status)."""


def checked(callbacks: Sequence[object]) -> list[Callback]:
    """``callbacks`` as a list, or a ``TypeError`` naming the first that is not a ``Callback``."""
    for cb in callbacks:
        if not isinstance(cb, Callback):
            raise TypeError(
                f"callbacks: {type(cb).__name__} is not an elastic.control.callbacks.Callback "
                "(subclass it and override after_step / after_event / before_reconfigure / close)"
            )
    return list(callbacks)  # type: ignore[arg-type]
