"""Staggered reads, pure arithmetic: which wave a host is in, and in which round a reader reads.

Host ``i`` of ``n`` reading hosts belongs to wave ``i // ceil(n / waves)``. Shared by the
data feeders (``elastic.ingest.waves``) and the checkpoint restore from storage
(``elastic.checkpoint.restore``). See docs/data.md.
"""

from __future__ import annotations

import math


def wave_of(host_index: int, hosts: int, waves: int) -> int:
    return host_index // math.ceil(hosts / max(1, min(waves, hosts)))


def read_rounds(reader_hosts: list[str | None], waves: int, max_reads_per_host: int) -> tuple[list[int | None], int]:
    """Rounds of a staggered read: ``(round of each rank, number of rounds)``.

    ``reader_hosts[r]`` is rank ``r``'s host, or None when it reads nothing. Reading hosts
    are numbered in order of their first reading rank and grouped into ``waves``; within a
    host, its readers (in rank order) take ``max_reads_per_host`` slots per round. Round
    ``wave * slots + slot``: a wave's hosts all read before the next wave starts, and no host
    has more than ``max_reads_per_host`` readers in one round. So at most
    ``ceil(hosts / waves) * max_reads_per_host`` ranks read at once.
    """
    hosts: dict[str, int] = {}
    for h in reader_hosts:
        if h is not None:
            hosts.setdefault(h, len(hosts))
    if not hosts:
        return [None] * len(reader_hosts), 0
    cap = max(1, max_reads_per_host)
    nth: dict[str, int] = {}
    slot_of: list[tuple[str, int] | None] = []  # each rank's (host, slot in its host), None: reads nothing
    for h in reader_hosts:
        if h is None:
            slot_of.append(None)
            continue
        slot_of.append((h, nth.get(h, 0) // cap))
        nth[h] = nth.get(h, 0) + 1
    slots = max(-(-k // cap) for k in nth.values())
    n = len(hosts)
    rounds = [None if hs is None else wave_of(hosts[hs[0]], n, waves) * slots + hs[1] for hs in slot_of]
    return rounds, (wave_of(n - 1, n, waves) + 1) * slots
