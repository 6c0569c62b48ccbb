"""The control plane at scale: the real driver over thousands of virtual ranks.

The driver is the project's own: ``Controller``, ``WorkerGroup`` (agent tree, commands,
digests, diagnosis, supervision), the recovery planning and every policy. Under it run real
Ray actors on this machine: the aggregators, and a ``NodeAgent`` actor for ``--real-agents``
nodes; the other nodes' agents are the same ``NodeCore`` hosted inside their aggregator. The
ranks are virtual (``elastic/testing/virtual_nodes.py``): they answer like real ones (step
reports with snapshots, anomalies none, snapshot holdings, configure replies) from the
clock, without torch. Only the ranks' process creation is replaced (``VirtualGroup.spawn``)
and the cluster's capacity (``VirtualSlots``); raylets are stand-in listening sockets, and a
lost node's socket is closed, so the driver's probes are real.

The run: ``--steps`` steps (with a driver stall of 2 x ``elastic.heartbeat_timeout_s`` in
the middle, on purpose: no failure may follow), then one node is lost (its agent dies, its
raylet refuses, every other rank sees a peer error), the recovery, a node returns, the
grow-back, a few steps. With ``--json`` the last line is one object (DESIGN section 10) with
``ranks``, ``nodes``, ``driver_cpu_per_step_s``, ``driver_cpu_per_recovery_s``,
``recovery_decision_s`` (failure seen -> every configure request sent),
``false_failures``, ``driver_rpcs_per_s`` and ``store_ops_per_rank_per_reform`` (from the
project's own process group on gloo at small world sizes, ``store_ops_model``), and more.
Results are merged into ``benchmarks/results/control_plane.json`` by rank count.

Driver CPU is the driver process's CPU time (every thread of it: Ray's own included).

    .venv/bin/python benchmarks/control_plane.py --ranks 1024 --json
    .venv/bin/python benchmarks/control_plane.py --ranks 16384 --json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import os
import platform
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "control_plane.json"


# --------------------------------------------------------------------------- the virtual cluster


@dataclass(eq=False)
class VirtualGroup:
    """A placement group of the virtual cluster: one whole replica on one node."""

    node: str


class Raylets:
    """Stand-in raylets: one listening socket for every live node, and one of its own for a
    node to be lost (closed when it is: its probes are then refused)."""

    def __init__(self) -> None:
        self.live = self._listener()
        self.own: dict[str, socket.socket] = {}

    def _listener(self) -> socket.socket:
        s = socket.create_server(("127.0.0.1", 0), backlog=4096)
        threading.Thread(target=self._accept, args=(s,), daemon=True).start()
        return s

    @staticmethod
    def _accept(s: socket.socket) -> None:
        while True:
            try:
                conn, _ = s.accept()
                conn.close()
            except OSError:
                return

    def address(self, node: str) -> tuple[str, int]:
        return (self.own[node] if node in self.own else self.live).getsockname()

    def set_apart(self, node: str) -> None:
        self.own[node] = self._listener()

    def lose(self, node: str) -> None:
        self.own[node].close()


class VirtualSlots:
    """``ReplicaSlots`` over the virtual cluster: one group per live node."""

    def __init__(self, nodes: list[str]):
        self.groups = {n: VirtualGroup(n) for n in nodes}

    def request(self, total: int) -> None:
        pass

    def ready(self, timeout: float = 0.0) -> list[VirtualGroup]:
        return list(self.groups.values())

    def exclude(self, nodes: set[str], keep: set[int]) -> None:
        for n in nodes:
            self.groups.pop(n, None)

    def release(self, group: VirtualGroup) -> None:
        self.groups.pop(group.node, None)

    def release_all(self) -> None:
        self.groups.clear()

    def add(self, node: str) -> None:
        self.groups[node] = VirtualGroup(node)


def virtual_group_class(world: Any, nodes: list[str], raylets: Raylets, real_agents: set[str], fan_in: int):
    """The project's ``WorkerGroup`` with the virtual cluster's capacity, ranks and agents."""
    from elastic.agent.actors import NodeAgent
    from elastic.control.worker_group import Member, WorkerGroup
    from elastic.testing.virtual_nodes import LocalVirtualAgent, VirtualRankRef

    class Group(WorkerGroup):
        agent_fan_in = fan_in

        def _make_slots(self):
            self.virtual = VirtualSlots(nodes)
            return self.virtual

        def _make_agent(self, node: str):
            if node in real_agents:
                return NodeAgent.options(name=None).remote(node, world.poll_wait_s, virtual=world)
            return LocalVirtualAgent(node, world)

        def spawn(self, groups):
            members = [Member(None, g, b, g.node, "10.0.0.1", 0) for g in groups for b in range(self.replica_size)]
            self._number(members)
            for m in members:
                m.actor = VirtualRankRef(m.wid)
            self.raylets.update({g.node: raylets.address(g.node) for g in groups})
            self._attach(members)
            return members

    return Group


# --------------------------------------------------------------------------- what the run measures


class Probe:
    """Subscribed to the job's events: when each happened, on the driver's clock, and the
    driver's CPU time then; and the benchmark's cues (lose a node, bring one back)."""

    def __init__(self) -> None:
        self.steps: dict[int, tuple[float, float]] = {}  # step -> (monotonic, cpu)
        self.calls: dict[int, int] = {}  # step -> the driver's calls into the agent tree so far
        self.counter = lambda: 0
        self.channels = 0  # the driver's channels into the tree, as of the first step
        self.profiler: Any = None  # --profile: the steady steps' profile
        self.profile_steps: tuple[int, int] = (0, 0)
        self.events: list[tuple[str, float, float, dict]] = []
        self.lock = threading.Condition()

    def __call__(self, event: dict) -> None:
        now, cpu = time.monotonic(), time.process_time()
        with self.lock:
            if event["kind"] == "step":
                self.steps.setdefault(event["step"], (now, cpu))
                if self.profiler is not None and event["step"] in self.profile_steps:
                    start = event["step"] == self.profile_steps[0]
                    self.profiler.enable() if start else self.profiler.disable()
                self.calls.setdefault(event["step"], self.counter())
                self.channels = self.channels or self.width()
            self.events.append((event["kind"], now, cpu, event))
            self.lock.notify_all()

    def wait(self, predicate, timeout_s: float) -> bool:
        with self.lock:
            return self.lock.wait_for(predicate, timeout=timeout_s)

    def of(self, kind: str) -> list[tuple[str, float, float, dict]]:
        return [e for e in self.events if e[0] == kind]


def make_stall(at_step: int, seconds: float):
    from elastic.control.callbacks import Callback

    class Stall(Callback):
        """The driver busy on purpose: nothing may be called silent for it."""

        def __init__(self) -> None:
            self.done_at: float | None = None

        def after_step(self, step, group) -> None:
            if step == at_step and self.done_at is None:
                time.sleep(seconds)
                self.done_at = time.monotonic()

    return Stall()


# --------------------------------------------------------------------------- the run


def job_spec(nodes: int, per_node: int, steps: int, hb: float):
    from jobs import JobSpec

    return JobSpec.from_dict(
        {
            "name": "control-plane",
            "model": {"n_layers": 1, "d_model": 64, "n_heads": per_node, "vocab_size": 64, "seq_len": 8},
            "data": {"source": "memory://virtual-corpus", "loader": "native"},
            "parallel": {"tp": per_node, "micro_batch": 1},  # one replica per node: DDP across nodes
            "elastic": {
                "min_dp": 1,
                "max_dp": nodes,
                "heartbeat_timeout_s": hb,
                "collective_timeout_s": 30,
                "grow_check_s": 1.0,
                "max_failures": 5,
            },
            "train": {"steps": steps, "global_batch": nodes * (nodes - 1)},  # dp = nodes and nodes - 1 allowed
            "checkpoint": {"every_steps": 0},
        }
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    import ray

    from elastic.control.controller import Controller
    from elastic.events import EventLog
    from elastic.testing.virtual_nodes import Fabric, VirtualWorld

    nodes = args.ranks // args.ranks_per_node
    names = [f"vnode-{i:05d}" for i in range(nodes)]
    lost, back = names[0], f"vnode-{nodes:05d}"
    real = set(names[: args.real_agents]) | {back}
    tmp = tempfile.mkdtemp(prefix="control-plane-")
    world = VirtualWorld(fabric_path=os.path.join(tmp, "fabric.json"), step_s=args.step_s)
    raylets = Raylets()
    raylets.set_apart(lost)
    hb = args.heartbeat_timeout_s
    extra = 30
    spec = job_spec(nodes, args.ranks_per_node, args.steps + extra, hb)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level=logging.ERROR)
    events = EventLog(os.path.join(tmp, "run"))
    probe = Probe()
    events.subscribe(probe)
    stall_at = max(2, args.steps // 2)
    stall = make_stall(stall_at, 2 * hb)

    class VirtualController(Controller):
        worker_group_cls = virtual_group_class(world, names, raylets, real, args.fan_in)

    load_start = os.getloadavg()
    t0 = time.monotonic()
    ctl = VirtualController(spec, events, "memory://virtual-corpus", callbacks=[stall])
    probe.counter = lambda: ctl.group.tree.calls
    probe.width = lambda: len(ctl.group.tree.channels)
    result: dict[str, Any] = {}

    def cues() -> None:
        """Lose a node after ``--steps`` steps; bring one back 5 steps after the recovery."""
        if not probe.wait(lambda: 3 in probe.steps, timeout_s=1800):
            return
        result["tree"] = tree_processes()
        if not probe.wait(lambda: args.steps in probe.steps, timeout_s=args.steps * args.step_s * 4 + 600):
            return
        result["lost_at"] = time.monotonic()
        raylets.lose(lost)
        Fabric.lose(world.fabric_path, lost)
        if not probe.wait(lambda: any(e[3].get("reason") == "node_lost" for e in probe.of("resize")), 600):
            return
        after = max(probe.steps) + 5
        probe.wait(lambda: after in probe.steps, 600)
        result["back_at"] = time.monotonic()
        ctl.group.virtual.add(back)

    if args.profile:
        import cProfile

        profile_recovery(ctl)
        probe.profiler, probe.profile_steps = cProfile.Profile(time.process_time), (5, min(args.steps, 15))
    threading.Thread(target=cues, daemon=True).start()
    try:
        ctl.run()
    finally:
        ray.shutdown()
    wall = time.monotonic() - t0
    if probe.profiler is not None:
        import pstats

        print(f"steps {probe.profile_steps}:", file=sys.stderr)
        pstats.Stats(probe.profiler, stream=sys.stderr).sort_stats("tottime").print_stats(30)
    return summarize(args, ctl, probe, result, stall, stall_at, nodes, wall, load_start, len(real))


def profile_recovery(ctl: Any) -> None:
    """Print where the driver's CPU went in each recovery (``--profile``)."""
    import cProfile
    import pstats

    inner = ctl._on_recovering

    def profiled(state):
        prof = cProfile.Profile(time.process_time)
        try:
            return prof.runcall(inner, state)
        finally:
            pstats.Stats(prof, stream=sys.stderr).sort_stats("cumulative").print_stats(35)

    ctl._on_recovering = profiled


def tree_processes() -> dict[str, Any]:
    """The agent tree's actor processes on this machine (Ray names them ``ray::Class``): how
    many, and their resident memory."""
    count, rss_kb = {"Aggregator": 0, "NodeAgent": 0}, 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace")
            kind = next((k for k in count if cmd.startswith(f"ray::{k}")), None)
            if kind is None:
                continue
            status = open(f"/proc/{pid}/status").read()
        except OSError:
            continue
        count[kind] += 1
        rss_kb += int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS")))
    return {"processes": count, "rss_gib": round(rss_kb / 2**20, 2)}


def summarize(args, ctl, probe, cues, stall, stall_at, nodes, wall, load_start, real) -> dict[str, Any]:
    steps = probe.steps
    warm = min(10, args.steps // 4)
    (t_a, c_a), (t_b, c_b) = steps[warm], steps[args.steps]
    failures = probe.of("failure")
    injected = [f for f in failures if f[3].get("cause") == "node_lost" and f[1] >= cues.get("lost_at", 1e18)]
    false_failures = len(failures) - len(injected[:1])
    out: dict[str, Any] = {
        "benchmark": "benchmarks/control_plane.py",
        "date_utc": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "host": {"hostname": platform.node(), "cpus": os.cpu_count(), "loadavg_start": load_start},
        "ranks": args.ranks,
        "nodes": nodes,
        "ranks_per_node": args.ranks_per_node,
        "step_s": args.step_s,
        "steps": args.steps,
        "real_agent_actors": real,
        "aggregator_actors": len(ctl.group.tree.children),
        "driver_channels": probe.channels,
        "driver_cpu_per_step_s": (c_b - c_a) / (args.steps - warm),
        "false_failures": false_failures,
        "stall_s": 2 * args.heartbeat_timeout_s,
        "stall_at_step": stall_at,
        "wall_s": wall,
        "tree_actors": cues.get("tree"),
    }
    if injected:
        _, t_fail, c_fail, _ = injected[0]
        first_after = min((s for s, (t, _) in steps.items() if t > t_fail and s > 0), default=None)
        resize = [e for e in probe.of("resize") if e[1] > t_fail]
        restore = [e for e in probe.of("restore") if e[1] > t_fail]
        sent = ctl.group.configure_sent_at
        out.update(
            recovery_decision_s=next((t - t_fail for t in sent if t > t_fail), None),
            driver_cpu_per_recovery_s=(steps[first_after][1] - c_fail) if first_after else None,
            recovery_s=(steps[first_after][0] - cues["lost_at"]) if first_after else None,
            detect_s=t_fail - cues["lost_at"],
            dp_after_loss=resize[0][3]["new_dp"] if resize else None,
            recovery_breakdown=restore[0][3].get("breakdown") if restore else None,
        )
    grows = [e for e in probe.of("resize") if e[3].get("reason") == "capacity returned"]
    if grows and "back_at" in cues:
        _, t_g, c_g, ev = grows[0]
        out.update(grow_back_s=t_g - cues["back_at"], dp_after_grow=ev["new_dp"])
    out["driver_rpcs_per_s"] = (probe.calls[args.steps] - probe.calls[warm]) / (t_b - t_a)
    if args.store_ops:
        out["store_ops_per_rank_per_reform"], out["store_ops_basis"] = store_ops_model(args.ranks, args.ranks_per_node)
    out["loadavg_end"] = os.getloadavg()
    return out


# --------------------------------------------------------------------------- store operations per re-formation

STORE_OPS_LAYOUTS = ((2, 2), (2, 4))  # (tp, dp) re-formed for real on gloo: world 4 and 8 (2 cores)


def store_ops_model(ranks: int, per_node: int) -> tuple[float | None, dict[str, Any]]:
    """Store operations per rank per re-formation at ``ranks``, from the project's own process
    group and mesh re-formed for real on gloo at small world sizes (``STORE_OPS_LAYOUTS``),
    extrapolated along the fitted power of the world size. Counted by the process group's
    own counter (``ReconfigurableProcessGroup.store_ops``) where it has one, else by a
    counting wrapper around its store client."""
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
        counts = [out.get(timeout=300) for _ in procs]
        for p in procs:
            p.join(timeout=60)
        measured[world] = max(c for c, _ in counts)
        source = counts[0][1]
    (w1, o1), (w2, o2) = sorted(measured.items())
    import math

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
        pg.configure(generation, rank, world, ("127.0.0.1", port))
        dims = ParallelDims(dp=dp, tp=tp, pp=1, world_size=world, timeout=pg.rendezvous_timeout)
        dims.build_mesh("cpu")
        pg.mesh_built([dims.world_mesh[name].get_group() for name in MESH_DIM_NAMES])
        pg.built()
        pg.settled()
        count = pg.ops() - before
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument("--ranks-per-node", type=int, default=8)
    ap.add_argument("--step-s", type=float, default=2.0)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--real-agents", type=int, default=16, help="nodes whose agent is an actor of its own")
    ap.add_argument("--heartbeat-timeout-s", type=float, default=10.0)
    ap.add_argument(
        "--fan-in", type=int, default=32, help="children per aggregator (elastic.control.agent_link.FAN_IN)"
    )
    ap.add_argument("--no-store-ops", dest="store_ops", action="store_false", help="skip the gloo store count")
    ap.add_argument("--profile", action="store_true", help="print the driver's CPU profile of each recovery")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--no-save", action="store_true", help="do not merge into benchmarks/results/control_plane.json")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    out = run(args)
    if not args.no_save:
        save(out)
    print(json.dumps(out) if args.json else json.dumps(out, indent=1))
    return 0


def save(out: dict[str, Any]) -> None:
    data = json.loads(RESULTS.read_text()) if RESULTS.exists() else {"benchmark": out["benchmark"], "runs": {}}
    data["runs"][str(out["ranks"])] = out
    data["date_utc"] = out["date_utc"]
    RESULTS.write_text(json.dumps(data, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
