"""Pure planning of what a re-formation keeps: each rank's state, its groups, its shard.

Runs in the driver, on plain values (old ranks, the new order), tested without Ray.
``recovery_plan.plan_reform`` calls it; its results travel to each rank in the optional
fields of its ``ConfigureRequest``:

- ``prior_rank``: the rank this member had in the layout it trained in (None: new);
- ``keep_state``: its live state is what its new rank needs (DDP: same (pp, tp)
  coordinate; HSDP: same place in a shard group too; FSDP: same rank at the same DP
  degree), so it restores nothing when it holds the resumed step (the worker checks the
  step, ``elastic/worker/actor.py``);
- ``unchanged_groups``: the mesh dimensions (``tp``, ``pp``) whose group has exactly the same
  members, in the same order, as before: what a backend that can keep communicators keeps;
- ``shrink_excluded``: when the new group is the old one less some ranks (same relative
  order, no newcomer), the old ranks left out: NCCL can then shrink the old communicator
  (``torch.distributed.shrink_group``) instead of bootstrapping a new one.

Layouts with EP or CP (``parallel.ep``/``parallel.cp`` above 1) keep nothing yet: every
rank restores as before (``keep_state`` False, no unchanged group); only ``prior_rank`` and
``shrink_excluded`` are planned for them.

HSDP (``parallel.shard_group``) makes losing a replica cheap only if the survivors stay in
place: :func:`hsdp_order` picks which whole replicas to keep (complete shard groups first,
then as many distinct places in a group as possible) and :func:`arrange_shard_groups` puts
each kept replica at its old place in its new group, newcomers in the gaps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Regroup:
    """What rank ``rank`` of a new layout keeps from the old one."""

    rank: int
    prior_rank: int | None
    keep_state: bool
    unchanged_groups: tuple[str, ...]
    shrink_excluded: tuple[int, ...] | None


def regroup(
    prior: Sequence[int | None],
    old_dp: int,
    dp: int,
    *,
    tp: int,
    pp: int,
    zero: int,
    shard_group: int | None = None,
    ep: int = 1,
    cp: int = 1,
) -> list[Regroup]:
    """For each new rank ``r`` (``prior[r]``: its old rank, None for a newcomer), what it keeps."""
    old_world = old_dp * tp * pp * ep * cp
    survivors = [p for p in prior if p is not None]
    shrink = None
    if all(p is not None for p in prior) and survivors == sorted(survivors) and len(survivors) < old_world:
        shrink = tuple(sorted(set(range(old_world)) - set(survivors)))
    if ep > 1 or cp > 1:  # (the module docstring: nothing kept yet)
        return [Regroup(rank, old, False, (), shrink) for rank, old in enumerate(prior)]
    # Whether a TP or PP group is unchanged is a property of the group, not of the rank:
    # answered once per group (O(N) in all, not O(N x (tp + pp)) tuple builds).
    tp_same = _tp_unchanged(prior, tp) if tp > 1 else None
    pp_same = _pp_unchanged(prior, dp, tp, pp) if pp > 1 else None
    replica = tp * pp
    out = []
    for rank, old in enumerate(prior):
        keep = False
        unchanged: tuple[str, ...] = ()
        if old is not None:
            if zero == 0:  # a replica: the same (pp, tp) place
                keep = old % replica == rank % replica
            elif shard_group:  # HSDP: the same place in a shard group too
                keep = (
                    old % replica == rank % replica
                    and (old // replica) % shard_group == (rank // replica) % shard_group
                )
            else:  # FSDP: the same rank at the same DP degree
                keep = old_dp == dp and old == rank
            in_tp = tp_same is not None and tp_same[rank // tp]
            in_pp = pp_same is not None and pp_same[(rank // replica) * tp + rank % tp]
            unchanged = ("tp", "pp") if in_tp and in_pp else ("tp",) if in_tp else ("pp",) if in_pp else ()
        out.append(Regroup(rank, old, keep, unchanged, shrink))
    return out


def _tp_unchanged(prior: Sequence[int | None], tp: int) -> list[bool]:
    """For each new TP group (ranks ``g*tp ..``): its members were one old TP group, in order."""
    out = []
    for g in range(len(prior) // tp):
        first = prior[g * tp]
        out.append(first is not None and first % tp == 0 and all(prior[g * tp + t] == first + t for t in range(1, tp)))
    return out


def _pp_unchanged(prior: Sequence[int | None], dp: int, tp: int, pp: int) -> list[bool]:
    """For each new PP group (DP rank ``d``, TP rank ``t``; index ``d*tp + t``): its members
    were one old PP group, stage by stage."""
    out = []
    for d in range(dp):
        for t in range(tp):
            first = prior[d * pp * tp + t]
            out.append(
                first is not None
                and (first // tp) % pp == 0
                and all(prior[(d * pp + p) * tp + t] == first + p * tp for p in range(1, pp))
            )
    return out


def hsdp_order(replicas: Sequence[Sequence[T]], old_rank: Any, shard_group: int, replica_size: int) -> list[list[T]]:
    """Whole replicas (each a DP rank's tp x pp members) in the order to keep them under HSDP.

    Complete old shard groups first, then the others, dealt round-robin by place in a group
    (``old DP rank % shard_group``): any prefix keeps as many complete groups and as many
    distinct places as the survivors allow, so the fewest ranks must fetch a shard.
    ``old_rank(member)`` is a member's rank in the old layout.
    """
    g = shard_group
    by_group: dict[int, list[Sequence[T]]] = {}
    for rep in replicas:
        dp_rank = old_rank(rep[0]) // replica_size
        by_group.setdefault(dp_rank // g, []).append(rep)
    groups = sorted(by_group.items(), key=lambda kv: (len(kv[1]) < g, kv[0]))
    buckets: list[list[Sequence[T]]] = [[] for _ in range(g)]
    for _, reps in groups:
        for rep in sorted(reps, key=lambda r: old_rank(r[0])):
            buckets[(old_rank(rep[0]) // replica_size) % g].append(rep)
    out: list[list[T]] = []
    while any(buckets):
        for b in buckets:
            if b:
                out.append(list(b.pop(0)))
    return out


def arrange_shard_groups(
    replicas: Sequence[Sequence[T]], old_rank: Any, shard_group: int, replica_size: int
) -> list[T]:
    """Members (whole replicas; newcomers have an old rank < 0) in consecutive groups of
    ``shard_group`` replicas, each surviving replica at its old place in its group where it
    is free; newcomers, then displaced survivors, fill the gaps. Group order follows the
    input's."""
    g = shard_group
    slots: list[list[Sequence[T] | None]] = [[None] * g for _ in range(len(replicas) // g)]
    rest: list[Sequence[T]] = []
    for rep in replicas:
        old = old_rank(rep[0])
        place = (old // replica_size) % g if old is not None and old >= 0 else -1  # -1: a newcomer
        target = next((grp for grp in slots if place >= 0 and grp[place] is None), None)
        if target is None:
            rest.append(rep)
        else:
            target[place] = rep
    rest.sort(key=lambda r: old_rank(r[0]) is not None and old_rank(r[0]) >= 0)  # newcomers first
    out: list[T] = []
    for grp in slots:
        for i in range(g):
            placed = grp[i]
            if placed is None:
                placed = grp[i] = rest.pop(0)
            out.extend(placed)
    return out
