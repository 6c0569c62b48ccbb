"""A node agent's calls for one command to some of its ranks, and what came back (``node.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class CallGather:
    """A command's calls to some ranks, and what came back."""

    cid: int
    waiting: set[int]
    replies: dict[int, Any] = field(default_factory=dict)
    errors: dict[int, str] = field(default_factory=dict)
    node_faults: set[int] = field(default_factory=set)  # of ``errors``: this node's own fault (a full disk)
    lost: list[int] = field(default_factory=list)
    unsent: int = 0  # errors and losses not yet sent up
    long_polls: dict[int, Any] = field(default_factory=dict)  # flush: wid -> the long poll it waits for
