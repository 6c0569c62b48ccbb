"""No cyclic garbage collection inside a re-formation's critical path.

At 16,384 ranks the driver tracks about half a million objects (members, indexes, plans,
the agent tree's bookkeeping), so one full (generation 2) collection takes 0.1-0.4 s of
CPU, and a recovery allocates enough to trigger several of them. Measured with the
control-plane benchmark at 16k ranks: 0.67 s of a recovery's 1.16 s of driver CPU was the
collector. A re-formation (starting, recovering, resizing) is short and its garbage is
mostly freed by reference counting, so the collector is paused for its length and left to
run as before in the steady state, where a collection costs a look, not a recovery.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def collector_paused() -> Iterator[None]:
    """The cyclic collector off for the block (as it was after it: a caller that had
    disabled it keeps it disabled)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
