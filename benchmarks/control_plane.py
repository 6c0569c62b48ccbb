"""The control plane at scale: the real driver over thousands of virtual ranks.

The driver is the project's own: ``Controller``, ``WorkerGroup`` (agent tree, commands,
digests, diagnosis, supervision), the recovery planning and every policy. Under it run real
Ray actors on this machine: the aggregators, and a ``NodeAgent`` actor for ``--real-agents``
nodes; the other nodes' agents are the same ``NodeCore`` hosted inside their aggregator. The
ranks are virtual (``elastic/testing/virtual_nodes.py``): they answer like real ones (step
reports with snapshots, anomalies none, snapshot holdings, configure replies) from the
clock, without torch. Only the ranks' process creation and the cluster's capacity are
replaced (``benchmarks/harness/virtual_cluster.py``); raylets are stand-in listening
sockets, and a lost node's socket is closed, so the driver's probes are real.

The run: ``--steps`` steps (with a driver stall of 2 x ``elastic.heartbeat_timeout_s`` in
the middle, on purpose: no failure may follow), then one node is lost (its agent dies, its
raylet refuses, every other rank sees a peer error), the recovery, a node returns, the
grow-back, a few steps. With ``--json`` the last line is one object (DESIGN section 10) with
``ranks``, ``nodes``, ``driver_cpu_per_step_s``, ``driver_cpu_per_recovery_s``,
``recovery_decision_s`` (failure seen -> every configure request sent),
``false_failures``, ``driver_rpcs_per_s`` and ``store_ops_per_rank_per_reform`` (from the
project's own process group on gloo at small world sizes, ``benchmarks/harness/store_ops.py``),
and more. Results are merged into ``--results`` (``benchmarks/results/control_plane.json``)
by rank count, next to the issue's goals; ``--no-save`` writes nothing.

Driver CPU is the driver process's CPU time (every thread of it: Ray's own included).
Runs in the process that was started (the driver), on one machine.

    python -m benchmarks.control_plane --ranks 1024 --json
    python -m benchmarks.control_plane --ranks 16384 --json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import threading
import time
from typing import Any

from benchmarks.harness.results import machine, results_path, utc_stamp, write_json
from benchmarks.harness.store_ops import store_ops_model
from benchmarks.harness.virtual_cluster import Raylets, tree_processes, virtual_group_class

# Issue 24's goals at 16,384 ranks / 2,048 nodes / 2 s steps on one 2-core machine.
GOALS = {
    "driver_cpu_per_step_s": "<= 0.05",
    "driver_cpu_per_recovery_s": "<= 2.0",
    "recovery_decision_s": "<= 1.0",
    "false_failures": "== 0 over 200 steps, with a driver stall of 2 x heartbeat_timeout_s",
    "driver_cpu_per_step_growth_1k_to_16k": "<= 20x",
}


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


def summarize(args, ctl, probe, cues, stall, stall_at, nodes, wall, load_start, real) -> dict[str, Any]:
    steps = probe.steps
    warm = min(10, args.steps // 4)
    (t_a, c_a), (t_b, c_b) = steps[warm], steps[args.steps]
    failures = probe.of("failure")
    injected = [f for f in failures if f[3].get("cause") == "node_lost" and f[1] >= cues.get("lost_at", 1e18)]
    false_failures = len(failures) - len(injected[:1])
    out: dict[str, Any] = {
        "benchmark": "benchmarks/control_plane.py",
        "date_utc": utc_stamp(),
        "host": {**machine(), "loadavg_start": load_start},
        "ranks": args.ranks,
        "nodes": nodes,
        "ranks_per_node": args.ranks_per_node,
        "step_s": args.step_s,
        "steps": args.steps,
        "real_agent_actors": real,
        "fan_in": args.fan_in,
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
    out["loadavg_end"] = os.getloadavg()
    return out


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
    ap.add_argument("--json", action="store_true", help="print the figures as one JSON object on the last line")
    ap.add_argument(
        "--results", default=results_path("control_plane.json"), help="the results file this run is merged into"
    )
    ap.add_argument("--no-save", action="store_true", help="write no results file")
    args = ap.parse_args(argv)
    if args.ranks < 2 * args.ranks_per_node or args.ranks % args.ranks_per_node:
        ap.error("--ranks: a multiple of --ranks-per-node, at least two nodes")
    if args.steps < 8:
        ap.error("--steps: at least 8 (warm-up, the stall, then the steady steps)")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    ops = store_ops_model(args.ranks, args.ranks_per_node) if args.store_ops else None  # first: on a quiet machine
    out = run(args)
    if ops is not None:
        out["store_ops_per_rank_per_reform"], out["store_ops_basis"] = ops
    if not args.no_save:
        save(args.results, out)
    print(json.dumps(out) if args.json else json.dumps(out, indent=1))
    return 0


def save(path: str, out: dict[str, Any]) -> None:
    """Merge this run into the results file by rank count, the goals and the growth of the
    driver's CPU per step from the smallest to the largest run next to it."""
    data = {"benchmark": out["benchmark"], "runs": {}}
    if os.path.exists(path):
        with open(path) as f:
            data = json.load(f)
    data["runs"][str(out["ranks"])] = out
    data["date_utc"] = out["date_utc"]
    write_json(path, with_goals(data), indent=1)


def with_goals(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with the issue's goals next to the largest run's figures, and the growth of
    the driver's CPU per step from the smallest run to the largest."""
    runs = sorted(data["runs"].values(), key=lambda r: r["ranks"])
    big, small = runs[-1], runs[0]
    measured = {k: big.get(k) for k in GOALS if k in big}
    if len(runs) > 1 and small.get("driver_cpu_per_step_s") and big.get("driver_cpu_per_step_s"):
        growth = big["driver_cpu_per_step_s"] / small["driver_cpu_per_step_s"]
        measured["driver_cpu_per_step_growth_1k_to_16k"] = f"{growth:.2f}x ({small['ranks']} -> {big['ranks']} ranks)"
    data["goals"] = {"at_ranks": big["ranks"], "goal": GOALS, "measured": measured}
    return data


if __name__ == "__main__":
    sys.exit(main())
