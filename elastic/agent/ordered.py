"""Calls applied in the order they were sent (agents and aggregators).

Ray runs the tasks of a threaded actor in no guaranteed order, even from one caller and in
one concurrency group of one thread. The tree's control calls (commands, and the changes to
its shape) must not overtake each other: a node's route must exist before a command for it
arrives, a launch must not overtake the configure before it. So every sender numbers its
calls to each receiver from 1, and the receiver applies each sender's calls in that order,
holding any that come early. A replaced sender (a new aggregator) has a new name, so its
numbering starts over. Calls of two senders (the driver changes the tree's shape, a parent
passes commands on) are not ordered with each other: the driver waits for a change of shape
to be applied before it sends anything that needs it (``agent_link.AgentTree``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class InOrder:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next: dict[str, int] = {}  # sender -> the number of its next call
        self._early: dict[tuple[str, int], tuple[Callable[..., Any], tuple]] = {}

    def run(self, sender: str, seq: int, fn: Callable[..., Any], *args: Any) -> None:
        """Apply ``fn(*args)``, call number ``seq`` of ``sender``, after every earlier one of it."""
        with self._lock:
            self._early[(sender, seq)] = (fn, args)
            n = self._next.get(sender, 1)
            while (sender, n) in self._early:  # under the lock: nothing overtakes while one applies
                fn, args = self._early.pop((sender, n))
                n += 1
                self._next[sender] = n
                fn(*args)


class Numbered:
    """A sender's side: the next number of its calls to each receiver."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._next: dict[str, int] = {}

    def next(self, receiver: str) -> int:
        n = self._next.get(receiver, 0) + 1
        self._next[receiver] = n
        return n

    def forget(self, receiver: str) -> None:
        """``receiver`` was replaced by a new actor: its numbering starts over."""
        self._next.pop(receiver, None)
