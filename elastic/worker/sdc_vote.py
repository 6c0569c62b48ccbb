"""The SDC vote: which ranks' parameter fingerprints disagree with their twins' (docs/health.md).

Pure, and on the workers' side of the actor boundary: every rank runs the same vote on the
same all-gathered fingerprints (``elastic/worker/sdc.py``); the controller only reads
``sdc_due`` to know which steps' checkpoints a passed check verifies.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class SdcVerdict:
    """The outcome of one fingerprint comparison.

    ``odd``: ranks whose fingerprint disagrees with their twin group. When a group has a
    strict majority, only the ranks outside it; without one (two replicas, or a tie), every
    rank of that group, and ``decided`` is False: nobody can tell which copy is wrong.
    """

    odd: tuple[int, ...] = ()
    decided: bool = True

    @property
    def ok(self) -> bool:
        return not self.odd


def vote(fingerprints: Sequence[int], groups: Sequence[Sequence[int]]) -> SdcVerdict:
    """Compare ``fingerprints`` (indexed by rank) within each group of ranks that must hold
    bitwise-identical parameters (the DP twins of one TP/PP shard)."""
    odd: list[int] = []
    decided = True
    for group in groups:
        values = [fingerprints[r] for r in group]
        if len(set(values)) <= 1:
            continue
        counts = {v: values.count(v) for v in set(values)}
        top, n = max(counts.items(), key=lambda kv: kv[1])
        if n * 2 > len(group) and list(counts.values()).count(n) == 1:
            odd += [r for r in group if fingerprints[r] != top]
        else:
            odd += list(group)
            decided = False
    return SdcVerdict(tuple(sorted(odd)), decided)


def twin_groups(coords: Sequence[tuple[int, ...]]) -> list[list[int]]:
    """Ranks grouped by the coordinates that fix their parameters (``(pp_rank, tp_rank)``, with
    ``ep_rank`` under EP): ``coords[rank]`` gives them."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for rank, key in enumerate(coords):
        groups.setdefault(tuple(key), []).append(rank)
    return [g for g in groups.values() if len(g) > 1]


def sdc_due(step: int, every: int, last_step: int) -> bool:
    """Is ``step`` an SDC check step? Every ``every`` steps and the last one (0: never)."""
    return every > 0 and (step % every == 0 or step == last_step)
