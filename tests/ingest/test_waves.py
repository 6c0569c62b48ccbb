"""Wave arithmetic and read plans (pure)."""

from __future__ import annotations

import math

import pytest

from elastic.ingest.rounds import read_rounds
from elastic.ingest.waves import read_plans, wave_of

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize("hosts, waves", [(4, 1), (4, 4), (4, 3), (3, 4), (7, 2), (1, 5)])
def test_at_most_ceil_hosts_over_waves_hosts_per_wave(hosts, waves):
    per_wave = {}
    for h in range(hosts):
        per_wave.setdefault(wave_of(h, hosts, waves), []).append(h)
    assert max(len(v) for v in per_wave.values()) <= math.ceil(hosts / waves)
    assert sorted(per_wave) == list(range(len(per_wave))) and len(per_wave) <= waves


def test_ranks_of_a_replica_read_from_their_leaders_host():
    # tp*pp = 2: replicas are ranks (0,1), (2,3), (4,5); leaders on nodes a, a, c.
    plans = read_plans(["a", "b", "a", "c", "c", "d"], replica_size=2, epoch="e")
    assert [p.feeder_node for p in plans] == ["a", "a", "a", "a", "c", "c"]
    assert [p.feeder_host for p in plans] == [0, 0, 0, 0, 1, 1] and {p.hosts for p in plans} == {2}
    # Each host's feeder serves the replicas led there: (0, 1) on a, (2,) on c, of 3.
    assert [p.replicas for p in plans] == [(0, 1)] * 4 + [(2,)] * 2 and {p.dp for p in plans} == {3}


def test_restore_read_rounds_by_wave_then_per_host_cap():
    # 4 hosts in 2 waves, host "a" has 3 readers with a cap of 2: 2 slots per wave.
    hosts = ["a", "a", "b", None, "c", "d", "a"]
    rounds, n = read_rounds(hosts, waves=2, max_reads_per_host=2)
    assert n == 4 and rounds == [0, 0, 0, None, 2, 2, 1]
    assert read_rounds(["a", "b"], waves=1, max_reads_per_host=0) == ([0, 0], 1)
    assert read_rounds([None, None], waves=4, max_reads_per_host=1) == ([None, None], 0)
    for hs, waves, cap in ((["a", "b", "c", "d", "e"], 4, 1), (["a"] * 5 + ["b"] * 2, 1, 2)):
        rounds, n = read_rounds(hs, waves, cap)
        per_round = [sum(r == k for r in rounds) for k in range(n)]
        assert max(per_round) <= math.ceil(len(set(hs)) / waves) * cap and all(per_round)
