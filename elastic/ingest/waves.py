"""Staggered reads: hosts start reading in ``data.waves`` groups (see docs/data.md).

Host ``i`` of ``n`` belongs to wave ``i // ceil(n / waves)``. A host of wave ``w`` starts
reading only once every host of the earlier waves has finished its initial fill, so at
most ``ceil(n / waves)`` hosts read at once while the job starts or recovers; each host
has at most ``data.max_reads_per_host`` reads in flight. A ``WaveGate`` actor per
(re)configuration keeps the count; a host of an earlier wave that never reports (it died)
delays the later ones by at most ``timeout_s``.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import ray

from elastic.ingest.rounds import wave_of


@dataclass(frozen=True)
class ReadPlan:
    """What a rank needs to know to read its data (built by the worker group per configure)."""

    epoch: str  # unique per (re)configuration: names the feeders and the gate
    feeder_node: str  # node of this rank's replica leader: the host whose feeder serves it
    feeder_host: int  # that host's index among the reading hosts
    hosts: int  # reading hosts (distinct replica-leader nodes)
    replicas: tuple[int, ...] = (0,)  # the DP ranks whose leader is on that host: what its feeder serves
    dp: int = 1  # replicas in the layout

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def read_plans(node_ids: list[str], replica_size: int, epoch: str) -> list[ReadPlan]:
    """One plan per rank (ranks in order; replica ``d`` is ranks ``[d*rs, (d+1)*rs)``)."""
    leaders = [node_ids[d] for d in range(0, len(node_ids), replica_size)]
    hosts: dict[str, int] = {}
    served: dict[str, list[int]] = {}
    for d, n in enumerate(leaders):
        hosts.setdefault(n, len(hosts))
        served.setdefault(n, []).append(d)
    return [
        ReadPlan(
            epoch,
            leaders[r // replica_size],
            hosts[leaders[r // replica_size]],
            len(hosts),
            tuple(served[leaders[r // replica_size]]),
            len(leaders),
        )
        for r in range(len(node_ids))
    ]


class _WaveGate:
    """Opens wave ``w`` once every host of the waves before it reported ``done`` (the
    ``WaveGate`` actor's body)."""

    def __init__(self, hosts: int, waves: int):
        self.hosts, self.waves = hosts, waves
        self.done_hosts: set[int] = set()
        self._changed = asyncio.Event()

    def _open(self, wave: int) -> bool:
        return all(h in self.done_hosts for h in range(self.hosts) if wave_of(h, self.hosts, self.waves) < wave)

    async def wait_turn(self, wave: int) -> bool:
        while not self._open(wave):
            self._changed.clear()
            await self._changed.wait()
        return True

    async def done(self, host_index: int) -> None:
        self.done_hosts.add(host_index)
        self._changed.set()

    async def state(self) -> list[int]:
        return sorted(self.done_hosts)


# Applied as a call, not a decorator: mypy keeps a decorated class's own type, so the actor
# class's .options() would be unknown to it.
WaveGate = ray.remote(num_cpus=0)(_WaveGate)


def gate(name: str, hosts: int, waves: int):
    """The gate actor called ``name`` (created by the first caller; others get it).

    Pinned to the caller's node: after a node loss Ray's node table still lists the dead
    node for a while, and a gate placed there would hold every wave until Ray notices.
    """
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    return WaveGate.options(name=name, get_if_exists=True, scheduling_strategy=here).remote(hosts, waves)
