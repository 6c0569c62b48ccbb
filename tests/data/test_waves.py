"""Wave arithmetic and read plans (pure)."""

from __future__ import annotations

import math

import pytest

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
