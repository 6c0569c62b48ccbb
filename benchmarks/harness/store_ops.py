"""Store operations per rank per re-formation, counted on the project's own process group
and mesh re-formed for real on gloo at small world sizes: extrapolated to the control-plane
benchmark's size (``store_ops_model``), and by world size for ``recovery_scaling``
(``store_ops_by_world``). Runs in the benchmark's driver process and in the rank processes it spawns.
"""

from __future__ import annotations

import math
import statistics
import tempfile
import time
from typing import Any

STORE_OPS_LAYOUTS = ((2, 2), (2, 4))  # (tp, dp) re-formed for real on gloo: world 4 and 8 (2 cores)


def store_ops_model(ranks: int, per_node: int) -> tuple[float | None, dict[str, Any]]:
    """Store operations per rank per re-formation at ``ranks``, from the project's own process
    group and mesh re-formed for real on gloo at small world sizes (``STORE_OPS_LAYOUTS``),
    extrapolated along the fitted power of the world size. Counted by the process group's
    own counter (``ReconfigurableProcessGroup.store_ops``) where it has one, else by a
    counting wrapper around its store client."""
    import queue

    import torch.multiprocessing as mp

    measured = {}
    for tp, dp in STORE_OPS_LAYOUTS:
        world = tp * dp
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        from torch.distributed import TCPStore

        server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        procs = [ctx.Process(target=_reform_twice, args=(r, tp, dp, server.port, out)) for r in range(world)]
        for p in procs:
            p.start()
        try:
            counts = [out.get(timeout=120) for _ in procs]
        except queue.Empty:  # a rank failed: say so, and keep the rest of the benchmark's figures
            for p in procs:
                p.kill()
            return None, {"error": f"a rank of the gloo re-formation at world {world} gave no count within 120 s"}
        for p in procs:
            p.join(timeout=60)
        measured[world] = max(c for c, _ in counts)
        source = counts[0][1]
    (w1, o1), (w2, o2) = sorted(measured.items())
    power = math.log(o2 / o1) / math.log(w2 / w1) if o1 and o2 else 0.0
    at = o2 * (ranks / w2) ** power if o2 else None
    return at, {"measured": measured, "power": round(power, 3), "counter": source, "layouts": STORE_OPS_LAYOUTS}


def _reform_twice(rank: int, tp: int, dp: int, port: int, out: Any) -> None:
    """One rank: join generation 1 (group and mesh), then re-form as generation 2 (the
    re-formation counted)."""
    import torch

    from elastic.parallel.dims import MESH_DIM_NAMES, ParallelDims
    from elastic.worker.process_group import ReconfigurableProcessGroup

    torch.set_num_threads(1)
    pg = _counting(ReconfigurableProcessGroup)("cpu", 60.0)
    world = tp * dp
    count = 0
    for generation in (1, 2):
        before = pg.ops()
        pg.join(generation, rank, world, ("127.0.0.1", port))
        dims = ParallelDims(dp=dp, tp=tp, pp=1, world_size=world, timeout=pg.rendezvous_timeout)
        dims.build_mesh("cpu")
        groups = [dims.world_mesh[name].get_group() for name in MESH_DIM_NAMES]
        pg.mesh_built(groups)
        pg.built()
        pg.settled()
        count = pg.ops() - before
        t = torch.ones(1)
        for g in groups:  # every connection made before anyone leaves (gloo connects lazily)
            torch.distributed.all_reduce(t, group=g)
    pg.leave()
    out.put((count, pg.source))


def _counting(cls):
    """``cls`` with an ``ops()`` count of its store operations: its own counter if it has one."""
    if hasattr(cls, "store_ops"):

        class Own(cls):
            source = "ReconfigurableProcessGroup.store_ops"

            def ops(self) -> int:
                return self._client.ops if self._client is not None else 0

        return Own
    import torch.distributed as dist

    class CountingStore(dist.Store):
        """Counts every call made on the store client (each is one round trip to the store)."""

        def __init__(self, inner: Any):
            super().__init__()
            self.inner, self.ops = inner, 0

        def _call(self, name: str, *args: Any) -> Any:
            self.ops += 1
            return getattr(self.inner, name)(*args)

        def set(self, key, value):
            return self._call("set", key, value)

        def get(self, key):
            return self._call("get", key)

        def add(self, key, value):
            return self._call("add", key, value)

        def compare_set(self, key, expected, desired):
            return self._call("compare_set", key, expected, desired)

        def wait(self, keys, *timeout):
            return self._call("wait", keys, *timeout)

        def check(self, keys):
            return self._call("check", keys)

        def delete_key(self, key):
            return self._call("delete_key", key)

        def num_keys(self):
            return self._call("num_keys")

        def set_timeout(self, timeout):
            return self.inner.set_timeout(timeout)

        @property
        def timeout(self):
            return self.inner.timeout

    class Counted(cls):
        source = "a counting wrapper around the store client (benchmarks/control_plane.py)"

        def _store_client(self, address):
            fresh = self._client is None or self._client_address != tuple(address)
            client = super()._store_client(address)
            if fresh:
                self._client = CountingStore(client)
            return self._client

        def ops(self) -> int:
            return self._client.ops if self._client is not None else 0

    return Counted


def _reform_ranks(rank: int, world: int, out: str, address: Any, secret: str, tp: int, pp: int, lazy: bool) -> list:
    import torch
    import torch.distributed as dist

    from elastic.parallel.dims import ParallelDims
    from elastic.worker.process_group import ReconfigurableProcessGroup

    group = ReconfigurableProcessGroup("cpu", 60)
    group.lazy_world = lazy
    rows = []
    for gen in range(1, 5):
        t0 = time.perf_counter()
        group.join(gen, rank, world, address, secret)
        dims = ParallelDims(dp=world // (tp * pp), tp=tp, pp=pp, world_size=world, timeout=group.rendezvous_timeout)
        dims.build_mesh("cpu")
        ops, join_s = group.store_ops(), time.perf_counter() - t0
        t = torch.ones(1)
        for g in dims.mesh_groups():  # one collective on each group: every connection made
            dist.all_reduce(t, group=g)
        rows.append((ops, join_s))
        del dims
        group.leave()
    return rows


def store_ops_by_world(worlds: list[int]) -> list[dict[str, Any]]:
    """``recovery_scaling``'s counts: store operations per rank per warm re-formation (and the
    join's time) of the project's process group and mesh re-formed for real on gloo, pure DP
    and tp 2 x pp 2, at each world size, with the world group made eagerly and lazily."""
    from elastic.testing.ranks import run_ranks
    from elastic.worker.process_group import RendezvousStore

    out = []
    for layout, (tp, pp) in (("dp", (1, 1)), ("tp2pp2", (2, 2))):
        for world in worlds:
            for lazy in (False, True):
                store = RendezvousStore("127.0.0.1", 60)
                with tempfile.TemporaryDirectory() as tmp:
                    rows = run_ranks(world, _reform_ranks, (store.address, store.secret, tp, pp, lazy), tmp)
                store.close()
                warm = [max(r[g][0] for r in rows) for g in range(1, 4)]  # generations 2-4: warm
                join = [max(r[g][1] for r in rows) for g in range(1, 4)]
                out.append(
                    {"layout": layout, "world": world, "world_group": "lazy" if lazy else "eager",
                     "store_ops_per_rank": max(warm), "join_s": statistics.median(join)}
                )  # fmt: skip
                r = out[-1]
                print(f"  store ops {layout:>6} at {world:>2} ranks, world group {r['world_group']:>5}: "
                      f"{r['store_ops_per_rank']:>3} per rank, join {r['join_s']:.2f}s", flush=True)  # fmt: skip
    return out
