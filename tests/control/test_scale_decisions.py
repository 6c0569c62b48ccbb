"""The control plane's per-step and per-recovery decisions in near-linear time: each new
implementation gives the old one's output, case for case, at small N (the old one is kept
here as the reference), and stays fast at 16,384 ranks.
"""

from __future__ import annotations

import random
import socket
import statistics
import time
from dataclasses import dataclass
from typing import Any

import pytest

from elastic.control import recovery_plan as plan
from elastic.control.diagnosis import RayletProbe, connect_all
from elastic.control.health import StragglerDetector, peer_medians
from elastic.control.regroup import regroup
from elastic.parallel.dims import rank_coords

pytestmark = pytest.mark.timeout(60)


@dataclass(eq=False)
class M:
    rank: int
    node_id: str


# --------------------------------------------------------------------------- the old implementations


def old_replica_peers(nodes: list[str], tp: int, pp: int, zero: int, ep: int = 1, cp: int = 1) -> list[int | None]:
    n, size = len(nodes), tp * pp * ep * cp

    def content(r: int) -> Any:
        return old_shard_of(r, tp, pp, zero, ep, cp)

    def off_node(k: int) -> bool:
        return all(nodes[(r + k) % n] != nodes[r] for r in range(n))

    shifts = [*range(size, n, size), *range(1, n)]
    shift = next((k for k in shifts if off_node(k)), None)
    load = [0] * n
    out: list[int | None] = []
    for r in range(n):
        twins = [q for q in range(n) if q != r and content(q) == content(r)]
        if any(nodes[q] != nodes[r] for q in twins):
            out.append(None)
            continue
        ring = [(r + k) % n for k in range(1, n)]
        far = [q for q in ring if nodes[q] != nodes[r]]
        far = [q for q in far if q // size != r // size] or far  # another replica first
        if far:
            peer = (r + shift) % n if shift is not None else min(far, key=lambda q: load[q])
        else:
            peer = ring[0] if ring and not twins else None
        if peer is not None:
            load[peer] += 1
        out.append(peer)
    return out


def old_shard_of(rank, tp, pp, zero, ep=1, cp=1):
    c = rank_coords(rank, tp, pp, ep, cp)
    return (c.pp_rank, c.tp_rank, c.ep_rank) if zero == 0 else rank


def old_owners_for(new_rank, holders, me, tp, pp, zero, ep=1, cp=1):
    def coord(rank: int) -> tuple[int, ...]:
        c = rank_coords(rank, tp, pp, ep, cp)
        return (c.pp_rank, c.tp_rank, c.ep_rank) if zero == 0 else (c.pp_rank, c.tp_rank)

    mine = {o: h for o, h in holders.items() if coord(o) == coord(new_rank)}
    if zero == 0 and mine:
        owner = next((o for o, h in mine.items() if h is me), next(iter(mine)))
        mine = {owner: mine[owner]}
    return {owner: (None if h is me else h) for owner, h in mine.items()}


def old_covers(owners, world, tp, pp, zero, ep=1, cp=1) -> bool:
    have = {old_shard_of(r, tp, pp, zero, ep, cp) for r in owners}
    return all(old_shard_of(r, tp, pp, zero, ep, cp) in have for r in range(world))


def old_straggler_feed(det: StragglerDetector, compute_s: dict[int, float]):
    if len(compute_s) < 2:
        return None
    ratios = {}
    for rank, own in compute_s.items():
        ref = statistics.median([v for r, v in compute_s.items() if r != rank])
        ratios[rank] = own / ref if ref > 0 else 1.0
    new = []
    for rank, ratio in ratios.items():
        if ratio > det.factor:
            det._run[rank] = det._run.get(rank, 0) + 1
            if det._run[rank] >= det.steps and rank not in det._reported:
                det._reported.add(rank)
                new.append(rank)
        else:
            det._run.pop(rank, None)
            det._reported.discard(rank)
    if not new:
        return None
    return (sorted(new), round(max(ratios[r] for r in new), 3))


def old_content(rank, dp, tp, pp, zero, shard_group):
    c = rank_coords(rank, tp, pp)
    if zero == 0:
        return ("replica", c.pp_rank, c.tp_rank)
    if shard_group:
        return ("hsdp", c.dp_rank % shard_group, c.pp_rank, c.tp_rank)
    return ("fsdp", dp, rank)


def old_group_members(rank, dim, tp, pp):
    c = rank_coords(rank, tp, pp)
    base = (c.dp_rank * pp + c.pp_rank) * tp
    if dim == "tp":
        return tuple(base + t for t in range(tp))
    return tuple((c.dp_rank * pp + p) * tp + c.tp_rank for p in range(pp))


def old_regroup_rows(prior, old_dp, dp, tp, pp, zero, shard_group):
    """keep_state and unchanged_groups, asked rank by rank (the implementation before caching per group)."""
    rows = []
    for rank, old in enumerate(prior):
        keep = old is not None and old_content(old, old_dp, tp, pp, zero, shard_group) == old_content(
            rank, dp, tp, pp, zero, shard_group
        )
        unchanged = []
        if old is not None:
            for dim, size in (("tp", tp), ("pp", pp)):
                members = old_group_members(rank, dim, tp, pp)
                if size > 1 and tuple(prior[r] for r in members) == old_group_members(old, dim, tp, pp):
                    unchanged.append(dim)
        rows.append((keep, tuple(unchanged)))
    return rows


# --------------------------------------------------------------------------- layouts to compare on


def _layouts(seed: int, count: int):
    rng = random.Random(seed)
    for _ in range(count):
        tp, pp = rng.choice([(1, 1), (2, 1), (1, 2), (2, 2), (4, 1)])
        ep, cp = rng.choice([(1, 1), (1, 1), (2, 1), (1, 2)])
        zero = rng.choice([0, 0, 1])
        replicas = rng.randint(1, 6)
        n = replicas * tp * pp * ep * cp + rng.choice([0, 0, 0, 1])  # now and then a world that is not whole
        kind = rng.choice(["blocks", "shuffled", "lopsided", "one", "two"])
        per_node = rng.randint(1, 4)
        if kind == "blocks":
            nodes = [f"n{r // per_node}" for r in range(n)]
        elif kind == "shuffled":
            nodes = [f"n{r // per_node}" for r in range(n)]
            rng.shuffle(nodes)
        elif kind == "lopsided":  # one node holds most ranks: no ring shift exists
            nodes = ["big" if rng.random() < 0.7 else f"n{rng.randint(0, 3)}" for _ in range(n)]
        elif kind == "one":
            nodes = ["only"] * n
        else:
            nodes = [rng.choice(["a", "b"]) for _ in range(n)]
        yield nodes, tp, pp, zero, ep, cp


def test_replica_peers_matches_the_old_implementation():
    cases = 0
    fallback = 0
    for nodes, tp, pp, zero, ep, cp in _layouts(seed=7, count=600):
        want = old_replica_peers(nodes, tp, pp, zero, ep, cp)
        assert plan.replica_peers(nodes, tp, pp, zero, ep, cp) == want, (nodes, tp, pp, zero, ep, cp)
        cases += 1
        fallback += plan.ring_shift(nodes) is None and len(set(nodes)) > 1
    assert cases == 600 and fallback > 30  # the least-loaded path was exercised too


def test_owner_index_matches_owners_for():
    rng = random.Random(3)
    for _ in range(300):
        tp, pp = rng.choice([(1, 1), (2, 1), (2, 2)])
        ep, cp = rng.choice([(1, 1), (2, 1), (1, 2), (2, 2)])
        zero = rng.choice([0, 1])
        world = tp * pp * ep * cp * rng.randint(1, 5)
        members = [M(r, f"n{r % 3}") for r in range(world)]
        holdings = []
        for m in members:  # its own snapshot, sometimes a peer's copy, sometimes nothing
            held = {} if rng.random() < 0.2 else {m.rank: [5]}
            if rng.random() < 0.3:
                held[rng.randrange(world)] = [5]
            holdings.append((m, held))
        holders = plan.holders_at(holdings, 5)
        index = plan.OwnerIndex(holders, tp, pp, zero, ep, cp)
        order = members[:]
        rng.shuffle(order)  # new ranks: any order of the members
        for new_rank, me in enumerate(order):
            want = old_owners_for(new_rank, holders, me, tp, pp, zero, ep, cp)
            assert index.owners(new_rank, me) == want
            assert plan.owners_for(new_rank, holders, me, tp, pp, zero, ep, cp) == want


def test_coord_of_is_rank_coords():
    for tp, pp, ep, cp in [
        (1, 1, 1, 1),
        (2, 1, 1, 1),
        (1, 3, 1, 1),
        (4, 2, 1, 1),
        (8, 4, 1, 1),
        (2, 3, 2, 2),
        (1, 2, 4, 1),
    ]:
        for rank in range(tp * pp * ep * cp * 5):
            c = rank_coords(rank, tp, pp, ep, cp)
            assert plan.coord_of(rank, tp, pp, 0, ep, cp) == (c.pp_rank, c.tp_rank, c.ep_rank)
            assert plan.coord_of(rank, tp, pp, 1, ep, cp) == (c.pp_rank, c.tp_rank)
            assert plan.shard_of(rank, tp, pp, 0, ep, cp) == old_shard_of(rank, tp, pp, 0, ep, cp)


def test_covers_matches_the_old_check():
    rng = random.Random(11)
    for _ in range(500):
        tp, pp = rng.choice([(1, 1), (2, 1), (2, 2), (4, 2)])
        ep, cp = rng.choice([(1, 1), (2, 1), (1, 2)])
        zero = rng.choice([0, 1])
        world = tp * pp * ep * cp * rng.randint(1, 4)
        owners = {rng.randrange(world + 3) for _ in range(rng.randint(0, world + 2))}
        want = old_covers(owners, world, tp, pp, zero, ep, cp)
        assert plan.covers(owners, world, tp, pp, zero, ep, cp) == want


def test_peer_medians_match_statistics_median():
    rng = random.Random(5)
    for n in [2, 3, 4, 5, 8, 9, 33]:
        for _ in range(20):
            values = [rng.choice([0.0, 1.0, 1.0, 2.5, rng.random()]) for _ in range(n)]
            got = peer_medians(__import__("numpy").array(values)).tolist()
            want = [statistics.median(values[:i] + values[i + 1 :]) for i in range(n)]
            assert got == want


def test_straggler_detector_matches_the_old_one_step_by_step():
    rng = random.Random(9)
    new, old = StragglerDetector(1.3, 3), StragglerDetector(1.3, 3)
    ranks = list(range(12))
    for step in range(200):
        present = ranks if step % 17 else ranks[:-2]  # now and then some ranks are missing
        compute = {r: 1.0 + 0.05 * rng.random() for r in present}
        for r in rng.sample(present, rng.randint(0, 3)):
            compute[r] *= rng.choice([1.2, 1.5, 2.0])
        if step % 50 == 0:
            compute = dict.fromkeys(present, 0.0)  # all zero: every ratio is 1
        got = new.feed(compute)
        want = old_straggler_feed(old, compute)
        assert (None if got is None else (got.ranks, got.slowdown)) == want, step
        assert new._run == old._run and new._reported == old._reported


# --------------------------------------------------------------------------- at 16,384 ranks


def test_regroup_matches_the_rank_by_rank_answers():
    rng = random.Random(24)
    checked = 0
    for _ in range(400):
        tp, pp = rng.choice([(1, 1), (2, 1), (1, 2), (2, 2), (4, 1), (2, 3)])
        zero = rng.choice([0, 0, 1, 3])
        shard_group = rng.choice([None, 2]) if zero else None
        old_dp = rng.randint(1, 6)
        dp = rng.randint(1, old_dp + 1)
        size = tp * pp
        old_world = list(range(old_dp * size))
        if rng.random() < 0.5:  # whole replicas survive, perhaps reordered, perhaps with newcomers
            reps = [old_world[i * size : (i + 1) * size] for i in range(old_dp)]
            rng.shuffle(reps)
            flat = [r for rep in reps for r in rep][: dp * size]
            prior = [None if rng.random() < 0.15 else r for r in flat] + [None] * (dp * size - len(flat))
        else:  # anything: ranks mixed across replicas
            pool = old_world + [None] * size
            rng.shuffle(pool)
            prior = pool[: dp * size]
        got = regroup(prior, old_dp, dp, tp=tp, pp=pp, zero=zero, shard_group=shard_group)
        want = old_regroup_rows(prior, old_dp, dp, tp, pp, zero, shard_group)
        assert [(r.keep_state, r.unchanged_groups) for r in got] == want, (prior, old_dp, dp, tp, pp, zero)
        checked += sum(1 for r in got if r.unchanged_groups)
    assert checked > 200  # the layouts did keep groups often enough to test the answer


def _cpu(fn, *args):
    t0 = time.process_time()
    out = fn(*args)
    return out, time.process_time() - t0


def test_decisions_at_16k_ranks_are_near_linear():
    """The work that took minutes at 16k ranks (issue 24's table) now takes well under a
    second each (CPU seconds; generous bounds for a loaded 2-core machine)."""
    n, per_node = 16384, 8
    nodes = [f"n{r // per_node}" for r in range(n)]
    _, peers_s = _cpu(plan.replica_peers, nodes, 8, 1, 1)  # FSDP: every rank needs a copy
    members = [M(r, nodes[r]) for r in range(n)]
    holdings = [(m, {m.rank: [9, 10]}) for m in members]
    _, covering_s = _cpu(plan.covering_step, [h for _, h in holdings], n, 8, 1, 0)
    order = list(reversed(members))

    def owners():
        index = plan.OwnerIndex(plan.holders_at(holdings, 10), 8, 1, 0)
        return [index.owners(r, m) for r, m in enumerate(order)]

    _, owners_s = _cpu(owners)
    det = StragglerDetector(1.3, 5)
    compute = {r: 1.0 + (r % 7) * 0.01 for r in range(n)}
    _, straggler_s = _cpu(det.feed, compute)
    prior = [r if r < 8192 else r + 4 for r in range(n - 4)] + [None] * 4  # a replica lost, a new one
    _, regroup_s = _cpu(lambda: regroup(prior, 2048, 2048, tp=2, pp=4, zero=0))
    assert regroup_s < 0.5, regroup_s
    assert peers_s < 2.0 and covering_s < 2.0 and owners_s < 2.0 and straggler_s < 0.5, (
        peers_s,
        covering_s,
        owners_s,
        straggler_s,
    )


def test_lopsided_layout_falls_back_in_near_linear_time():
    n = 4096
    nodes = ["big" if r % 3 else f"n{r}" for r in range(n)]  # no ring shift exists
    assert plan.ring_shift(nodes) is None
    _, s = _cpu(plan.replica_peers, nodes, 1, 1, 1)
    assert s < 2.0, s


# --------------------------------------------------------------------------- raylet probes in parallel


def test_raylet_probes_run_in_parallel():
    """Many silent raylets cost one connect timeout in all, not one each; a refused port and
    a listening one are told apart in the same probe."""
    live = socket.create_server(("127.0.0.1", 0))
    gone = socket.create_server(("127.0.0.1", 0))
    gone_addr = gone.getsockname()
    gone.close()
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(0)
    held = [socket.create_connection(silent.getsockname(), timeout=1.0)]  # its backlog is full
    try:
        targets = {"live": live.getsockname(), "gone": gone_addr}
        targets.update({f"slow{i}": silent.getsockname() for i in range(20)})
        t0 = time.monotonic()
        out = connect_all(targets, timeout_s=0.3)
        took = time.monotonic() - t0
        assert out["live"] == "ok" and out["gone"] == "refused"
        assert all(out[f"slow{i}"] == "timeout" for i in range(20))
        assert took < 0.3 * 5, took  # sequential probes would take 20 x 0.3 s
        probe = RayletProbe()
        probe.update(targets)
        assert probe.dead(set(targets), wait_s=0.0, refused_only=True) == {"gone"}
    finally:
        for s in held:
            s.close()
        silent.close()
        live.close()
