"""Pure recovery planning: what a re-formation keeps, in which order, and from where.

Everything here works on plain values (ranks, node ids, snapshot holdings) and is tested
without Ray. The controller (``elastic/control/controller.py``) asks the worker group for
the facts once (who holds which snapshots), makes one ``ReformPlan`` here, and the worker
group (``elastic/control/worker_group/``) only carries it out.

- which survivors form whole model replicas (``complete_replicas``);
- the new rank order, rack by rack (``rank_order``);
- which snapshot step the survivors can restore (``covering_step``), and which old ranks'
  snapshots each new rank reads (``owners_for``);
- which rank keeps a copy of which rank's snapshots (``replica_peers``);
- the size to re-form at (``plan_recovery``);
- the whole re-formation, every rank's part of it included (``plan_reform``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, Protocol, TypeVar, cast

from elastic.control import policies
from elastic.control.peer_ring import LeastLoaded, ring_shift
from elastic.control.regroup import Regroup, arrange_shard_groups, regroup
from elastic.parallel.dims import rank_coords


class Ranked(Protocol):
    rank: int
    node_id: str


M = TypeVar("M", bound=Ranked)
Holdings = dict[int, list[int]]  # one worker's memory tier: owner rank -> the steps it holds
Source = Literal["memory", "storage", "none"]


def shard_of(rank: int, tp: int, pp: int, zero: int, ep: int = 1, cp: int = 1, shard_group: int | None = None) -> Any:
    """What a rank's training state is: its (pp, tp, ep) coordinate under DDP (every DP
    replica holds the same, and so do the CP ranks of a replica: CP splits activations,
    not parameters; EP ranks hold different experts), the rank itself under FSDP (every
    shard is unique: dense parameters are sharded over dp x ep x cp), and under HSDP
    (``shard_group``, only with ep = cp = 1) its place in its shard group with its (pp, tp)
    coordinate (the shard groups replicate each other, and their size never changes)."""
    if zero == 0:
        return coord_of(rank, tp, pp, 0, ep, cp)
    if shard_group:
        c = rank_coords(rank, tp, pp, ep, cp)
        return (c.dp_rank % shard_group, c.pp_rank, c.tp_rank)
    return rank


def coord_of(rank: int, tp: int, pp: int, zero: int, ep: int = 1, cp: int = 1) -> tuple[int, ...]:
    """The coordinate whose snapshots a rank reads: ``rank_coords``' (pp, tp, ep) under DDP,
    (pp, tp) under FSDP, computed without building the coordinate object: the planning asks
    it for every rank (``tests/control/test_scale_decisions.py`` checks that the two agree)."""
    rest, tp_rank = divmod(rank, tp)
    ep_rank = (rest // cp) % ep
    pp_rank = (rest // (cp * ep)) % pp
    return (pp_rank, tp_rank, ep_rank) if zero == 0 else (pp_rank, tp_rank)


def complete_replicas(members: Iterable[M], replica_size: int) -> list[list[M]]:
    """``members`` grouped into whole replicas (by old DP rank), each in rank order."""
    by_replica: dict[int, list[M]] = {}
    for m in members:
        by_replica.setdefault(m.rank // replica_size, []).append(m)
    return [sorted(ms, key=lambda m: m.rank) for _, ms in sorted(by_replica.items()) if len(ms) == replica_size]


def rank_order(members: Sequence[M], replica_size: int, rack_of: Callable[[str], str]) -> list[M]:
    """Whole replicas (consecutive chunks of ``members``) ordered rack by rack, then by node.

    DP ranks follow replica order, so the DP ring visits each rack's replicas together and
    crosses racks as few times as possible. Inside a replica the order is kept (TP fastest,
    then PP), matching the mesh ``("dp", "pp", "tp")``.
    """
    replicas = [list(members[i : i + replica_size]) for i in range(0, len(members), replica_size)]
    replicas.sort(key=lambda r: (rack_of(r[0].node_id), r[0].node_id))
    return [m for r in replicas for m in r]


def covers(
    owners: Iterable[int],
    world: int,
    tp: int,
    pp: int,
    zero: int,
    ep: int = 1,
    cp: int = 1,
    shard_group: int | None = None,
) -> bool:
    """Do snapshots of these old ranks hold the whole training state of a ``world``-rank layout?

    O(len(owners) + the period of the layout's shards): under DDP they repeat every replica
    (``tp * pp * ep * cp`` ranks), under HSDP every shard group of replicas, under FSDP every
    rank below ``world`` is its own shard.
    """
    if zero and not shard_group:
        return len({r for r in owners if 0 <= r < world}) == world
    period = tp * pp * ep * cp * ((shard_group or 1) if zero else 1)
    # A rank's shard depends on its rank modulo the period only: the shard of each residue
    # is asked once, not the shard of every owner (16k calls per step held at 16k ranks).
    residues = {int(r) % period for r in owners}
    have = {shard_of(r, tp, pp, zero, ep, cp, shard_group) for r in residues}
    return all(shard_of(r, tp, pp, zero, ep, cp, shard_group) in have for r in range(min(world, period)))


def covering_step(
    holdings: Iterable[dict[int, list[int]] | None],
    world: int,
    tp: int,
    pp: int,
    zero: int,
    ep: int = 1,
    cp: int = 1,
    shard_group: int | None = None,
) -> int | None:
    """The newest step whose snapshots, over all ``holdings`` (owner rank -> steps, one
    dict per live member; None for a member that did not answer), cover the old layout.
    O(the holdings' total size)."""
    owners_at: dict[int, set[int]] = {}
    for held in holdings:
        for owner, steps in (held or {}).items():
            for s in steps:
                owners_at.setdefault(s, set()).add(int(owner))
    good = [s for s, owners in owners_at.items() if covers(owners, world, tp, pp, zero, ep, cp, shard_group)]
    return max(good) if good else None


def holders_at(holdings: Sequence[tuple[M, dict[int, list[int]] | None]], step: int) -> dict[int, M]:
    """Old rank -> a live member holding that rank's snapshot of ``step`` (its owner first)."""
    held: dict[int, M] = {}
    for m, info in holdings:
        for owner, steps in (info or {}).items():
            owner = int(owner)
            if step in steps and (owner not in held or owner == m.rank):
                held[owner] = m
    return held


def owners_for(
    new_rank: int,
    holders: dict[int, M],
    me: M,
    tp: int,
    pp: int,
    zero: int,
    ep: int = 1,
    cp: int = 1,
    shard_group: int | None = None,
) -> dict[int, M | None]:
    """The old ranks whose snapshots the member ``me`` (new rank ``new_rank``) reads, and
    who serves each: None where ``me`` holds it itself.

    It needs the shards of its own coordinate: under DDP one copy of its (pp, tp, ep)
    state (its own if it has one: any DP replica or CP rank holds the same), under FSDP
    every shard of its (pp, tp) coordinate (dense parameters are sharded over dp x ep x
    cp, experts over dp x cp: resharding reads them all), and under HSDP one copy of its
    own shard (its own if it has one), the groups being replicas of each other. For many
    ranks, build one ``OwnerIndex`` and ask it (``plan_reform`` does).
    """
    return OwnerIndex(holders, tp, pp, zero, ep, cp, shard_group).owners(new_rank, me)


class OwnerIndex(Generic[M]):
    """``owners_for`` for every rank of a layout in O(1) each under DDP (O(dp) under FSDP,
    the size of the answer): the holders indexed once by coordinate and holder."""

    def __init__(
        self,
        holders: dict[int, M],
        tp: int,
        pp: int,
        zero: int,
        ep: int = 1,
        cp: int = 1,
        shard_group: int | None = None,
    ):
        self.dims = (tp, pp, zero, ep, cp)
        self.shard_group = shard_group if zero else None
        self.one_copy = zero == 0 or bool(self.shard_group)  # DDP, HSDP: any copy of the own shard
        self.by_coord: dict[tuple[int, ...], list[tuple[int, M]]] = {}  # in ``holders`` order
        self.first_of: dict[tuple[tuple[int, ...], int], int] = {}  # (coord, id(holder)) -> first owner
        for owner, holder in holders.items():
            coord = self._key(owner)
            self.by_coord.setdefault(coord, []).append((owner, holder))
            self.first_of.setdefault((coord, id(holder)), owner)

    def _key(self, rank: int) -> tuple[int, ...]:
        if self.shard_group:
            return shard_of(rank, *self.dims, self.shard_group)
        return coord_of(rank, *self.dims)

    def owners(self, new_rank: int, me: M) -> dict[int, M | None]:
        coord = self._key(new_rank)
        mine = self.by_coord.get(coord, [])
        if self.one_copy and mine:
            owner = self.first_of.get((coord, id(me)))
            holder = me if owner is not None else mine[0][1]
            owner = owner if owner is not None else mine[0][0]
            return {owner: None if holder is me else holder}
        return {owner: (None if h is me else h) for owner, h in mine}


@dataclass(frozen=True)
class RecoveryPlan:
    """How to re-form after a failure: keep the first ``dp - grow`` whole replicas, drop the
    others, and start ``grow`` new replicas in spare placement groups."""

    dp: int
    keep: int
    grow: int


def plan_recovery(whole_replicas: int, spare: int, allowed: list[int]) -> RecoveryPlan | None:
    """The largest allowed DP the surviving whole replicas plus spare capacity reach, or None."""
    dp = policies.target_dp(whole_replicas + spare, allowed)
    if dp is None:
        return None
    keep = min(dp, whole_replicas)
    return RecoveryPlan(dp=dp, keep=keep, grow=dp - keep)


def replica_peers(
    nodes: list[str], tp: int, pp: int, zero: int, ep: int = 1, cp: int = 1, shard_group: int | None = None
) -> list[int | None]:
    """For each rank (``nodes[r]`` is rank r's node), the rank that keeps a copy of its
    memory snapshots, or None where no copy is needed.

    A rank needs a copy unless a rank on another node already holds the same state: under
    DDP (``zero`` 0) the DP replicas and CP ranks of a (pp, tp, ep) coordinate are
    identical, under FSDP every shard is unique, under HSDP the shard groups replicate each
    other. Copies go to another node, so a node loss
    never takes a shard and its copy together, and to another replica where one exists on
    another node, because a node loss ends its whole replica (the re-formation keeps whole
    replicas only). The same ring shift is used for every rank where one exists that moves
    each rank off its node (shifts by whole replicas first), so every rank holds at most one
    peer's copies; otherwise each rank picks the least-loaded rank on another node (in
    another replica first), the nearest in ring order first. On a single node the copy goes
    to the next rank (another process), unless an identical replica already lives in
    another process.

    O(N * ranks per node) with a ring shift, O(N log N) more without (``peer_ring.py``).
    """
    n, size = len(nodes), tp * pp * ep * cp
    content = [shard_of(r, tp, pp, zero, ep, cp, shard_group) for r in range(n)]
    twin_nodes: dict[Any, set[str]] = {}
    for r, c in enumerate(content):
        twin_nodes.setdefault(c, set()).add(nodes[r])
    twins_count = Counter(content)
    on_node = Counter(nodes)
    if all(len(twin_nodes[c]) > 1 for c in twin_nodes):  # DDP over nodes: every state lives twice already
        return [None] * n
    shift = ring_shift(nodes, prefer_multiples_of=size)
    nearest = None if shift is not None or len(on_node) < 2 else LeastLoaded(nodes, replica_size=size)
    out: list[int | None] = []
    for r in range(n):
        if len(twin_nodes[content[r]]) > 1:  # an identical replica lives on another node
            out.append(None)
            continue
        if on_node[nodes[r]] < n:  # some rank lives on another node: two nodes at least, so
            # ``nearest`` was built wherever no ring shift fits
            peer: int | None = (r + shift) % n if shift is not None else cast(LeastLoaded, nearest).pick(r)
        else:
            peer = (r + 1) % n if n > 1 and twins_count[content[r]] == 1 else None
        out.append(peer)
    return out


@dataclass(frozen=True)
class RestoreChoice:
    """Where the state of the step training resumes from comes from."""

    step: int | None  # None with source "none": a fresh start
    source: Source


@dataclass(frozen=True)
class ReformPlan(Generic[M]):
    """One re-formation, decided whole: the worker group carries it out and decides nothing.

    ``members[r]`` becomes rank ``r``; ``owners[r]`` (memory restores) maps each old rank
    whose snapshot rank ``r`` reads to the member serving it (None: ``r`` holds it itself);
    ``peers[r]`` is the rank keeping copies of ``r``'s snapshots (None: no copy needed);
    ``regroup[r]`` what rank ``r`` keeps from the old layout (``regroup.py``; empty when the
    old layout is not known).
    """

    members: list[M]
    dp: int
    step: int  # the step training resumes from (the restored one, or the live one)
    restore: RestoreChoice
    owners: list[dict[int, M | None]]
    peers: list[int | None]
    regroup: list[Regroup] = field(default_factory=list)


def plan_reform(
    members: Sequence[M],
    dp: int,
    step: int,
    restore: RestoreChoice,
    holdings: Sequence[tuple[M, Holdings | None]],
    *,
    tp: int,
    pp: int,
    zero: int,
    replicate: bool,
    rack_of: Callable[[str], str],
    ep: int = 1,
    cp: int = 1,
    shard_group: int | None = None,
    old_dp: int | None = None,
) -> ReformPlan[M]:
    """The whole re-formation of ``members`` (whole replicas, any order) at ``dp``.

    ``holdings`` is the one snapshot query of the old layout's live members (kept or not:
    a worker that is about to leave can still serve its snapshots). Under HSDP
    (``shard_group``) whole shard groups are ordered rack by rack, each survivor at its old
    place in its group. ``old_dp``: the layout the members' ranks (``member.rank``, < 0 for
    a newcomer) refer to, for ``ReformPlan.regroup``.
    """
    replica = tp * pp * ep * cp
    if shard_group:
        replicas = [members[i : i + replica] for i in range(0, len(members), replica)]
        members = arrange_shard_groups(replicas, lambda m: m.rank, shard_group, replica)
    order = rank_order(members, replica * (shard_group or 1), rack_of)
    owners: list[dict[int, M | None]] = [{} for _ in order]
    if restore.source == "memory" and restore.step is not None:
        index = OwnerIndex(holders_at(holdings, restore.step), tp, pp, zero, ep, cp, shard_group)
        owners = [index.owners(rank, m) for rank, m in enumerate(order)]
    peers: list[int | None] = [None] * len(order)
    if replicate:
        peers = replica_peers([m.node_id for m in order], tp, pp, zero, ep, cp, shard_group)
    resume = restore.step if restore.step is not None else step
    kept: list[Regroup] = []
    if old_dp:
        prior = [m.rank if m.rank >= 0 else None for m in order]
        kept = regroup(prior, old_dp, dp, tp=tp, pp=pp, zero=zero, shard_group=shard_group, ep=ep, cp=cp)
    return ReformPlan(list(order), dp, resume, restore, owners, peers, kept)
