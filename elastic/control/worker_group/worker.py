"""One worker of the group as the driver keeps it: its actor, where it runs, its rank,
and what the driver last learned of it (driver side)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from elastic.messages import Connection, RunOutcome


@dataclass
class Member:
    actor: Any
    group: Any  # placement group
    bundle: int
    node_id: str
    ip: str
    pid: int
    wid: int = -1  # the worker's id: how its agent names it
    rank: int = -1
    last_ok: float = field(default_factory=time.monotonic)  # driver clock: when it was last known to answer
    run_result: RunOutcome | None = None
    returned_at: float = 0.0  # driver clock: when its run() ended (or its actor died)
    dead: bool = False
    step: int = 0
    silent_s: float = 0.0  # how long its poll is past due, as its agent last said
    since: int = 0  # the command (configure or launch) its current run belongs to
    launched: bool = False  # its run() was started (since its last configure)
    quiet: bool = False  # its run ended and nothing was asked of it since: all it reported is in
    connections: tuple[Connection, ...] = ()  # its group's TCP links (its configure answer)
