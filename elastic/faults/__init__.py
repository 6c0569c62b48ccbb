"""Fault injection: a tool of the project, used by the tests, the demo and the benchmarks.

Two halves:

* ``WorkerFaults`` runs inside a worker, at the start of a step: corrupt the weights with
  NaN (silent data corruption), blow a weight up (a loss spike), raise inside the step, or
  hang the training thread (a collective that never completes for its peers). Each of these
  fires once per job, so the replayed step after a recovery runs clean. ``slow`` makes the
  worker that is ``rank`` at ``step`` a straggler for every step from then on (it stays
  with that worker when a resize renumbers the ranks). ``hold`` (a test's condition, not a
  fault) keeps a rank from starting a step while the run is below ``below_dp`` replicas
  and the file ``marker`` exists, until the controller asks the group to stop (to resize)
  or ``seconds`` pass; it keeps the heartbeat going meanwhile. A test that must see the
  group grow back before the run ends waits on this condition instead of racing a timer.
* ``FaultInjector`` runs in the driver as a controller callback and acts on processes
  with real signals when step ``k`` completes: SIGKILL a worker, SIGSTOP a worker, or kill a
  whole node of a ``ray.cluster_utils.Cluster`` (SIGKILL its worker processes, then
  ``remove_node``), and optionally bring a node back later. ``drain`` asks Ray itself to
  drain a node (``GcsClient.drain_node``, the API of ``ray drain-node`` and of autoscaler
  v2) with a deadline, as a preemption notice does, and reclaims the node (``kill_node``)
  when the deadline passes if it is still there.

Driver-side signals need the workers on the driver's machine: that is the case for the
embedded and ``Cluster``-based local clusters these faults are made for.

Longer than the ~350 lines we aim for: every injected fault (worker-side hook, driver-side
signals, the ``--fault`` parser) in one file, so that the fault tool has one home.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from elastic.control.callbacks import Callback

log = logging.getLogger(__name__)

# ``hold`` is a test's condition, not a failure: it is not offered by ``--fault``.
WORKER_FAULT_KINDS = ("nan", "spike", "raise", "hang", "slow", "bitflip", "hold")
_EVERY_STEP = ("slow", "hold")  # from ``step`` on, not once
DRIVER_FAULT_KINDS = ("kill_worker", "stop_worker", "kill_node", "drain")
FAULT_KINDS = ("kill_worker", "kill_node", "stop_worker", "nan", "spike", "raise", "hang", "slow", "bitflip", "drain")
DRAIN_DEADLINE_S = 30.0  # drain: the default notice before the node is reclaimed


class InjectedError(RuntimeError):
    """The exception a ``raise`` fault throws inside a training step."""


def worker_fault(
    kind: str, step: int, rank: int = 0, seconds: float = 0.0, bit: int = 30, **extra: Any
) -> dict[str, Any]:
    """``bit``: the bit a ``bitflip`` flips; ``extra``: ``hold`` takes ``marker`` (a file path) and ``below_dp``."""
    if kind not in WORKER_FAULT_KINDS:
        raise ValueError(f"unknown worker fault {kind!r}; expected one of {WORKER_FAULT_KINDS}")
    if kind == "hold" and set(extra) != {"marker", "below_dp"}:
        raise ValueError("a hold needs marker= and below_dp=")
    return {"kind": kind, "step": step, "rank": rank, "seconds": seconds, "bit": bit, **extra}


class WorkerFaults:
    """Faults injected inside the workers' steps: a ``StepHook`` (``elastic/worker/hooks.py``).

    Give it to a job as ``ElasticTrainer(spec, step_hook=WorkerFaults([...]))``; the list
    comes from :func:`worker_fault` or from ``--fault`` (:func:`build_faults`).
    """

    def __init__(self, faults: list[dict[str, Any]]):
        self._pending = list(faults)
        # Set in the worker by ``attach`` (the hook travels there pickled, without them).
        self._stop: threading.Event | None = None  # the worker's "stop at the next step boundary"
        self._beat: Callable[[], None] | None = None  # the worker's heartbeat

    def attach(self, stop: threading.Event, beat: Callable[[], None]) -> None:
        self._stop, self._beat = stop, beat

    def pending(self, step: int, rank: int) -> bool:
        """A one-shot fault is due now (the worker then waits for its last snapshot)."""
        return any(f["step"] == step and f["rank"] == rank and f["kind"] not in _EVERY_STEP for f in self._pending)

    def before_step(self, step: int, rank: int, engine: Any) -> None:
        for fault in self._pending:
            if fault["kind"] == "slow" and step >= fault["step"]:
                # A slow device stays with its worker: decided once, by the rank this worker
                # has at its first step from ``step`` on (ranks are renumbered by a resize).
                if fault.setdefault("_here", fault["rank"] == rank):
                    _slow_forward(engine, fault["seconds"])  # a straggler: every step from then on
            if fault["kind"] == "hold" and step >= fault["step"] and fault["rank"] == rank:
                self._hold(fault, engine)
        for fault in list(self._pending):
            if fault["kind"] in _EVERY_STEP:
                continue
            if fault["step"] != step or fault["rank"] != rank:
                continue
            self._pending.remove(fault)
            kind = fault["kind"]
            if kind == "raise":
                raise InjectedError(f"injected failure in step {step} on rank {rank}")
            if kind == "hang":
                time.sleep(fault["seconds"])
            elif kind in ("nan", "spike", "bitflip"):
                import torch

                with torch.no_grad():
                    # The output head (the last matrix): scaling it is a sure loss spike.
                    param = [p for p in engine.model.parameters() if p.dim() >= 2][-1]
                    local = param.to_local() if hasattr(param, "to_local") else param
                    if kind == "nan":
                        local.fill_(float("nan"))
                    elif kind == "spike":
                        local.mul_(60.0)
                    else:
                        flip_bit(local, fault.get("bit", 30))

    def _hold(self, fault: dict[str, Any], engine: Any) -> None:
        deadline = time.monotonic() + fault["seconds"]
        stop = self._stop or threading.Event()
        while (
            engine.dims.dp < fault["below_dp"]
            and os.path.exists(fault["marker"])
            and not stop.is_set()
            and time.monotonic() < deadline
        ):
            if self._beat is not None:
                self._beat()
            stop.wait(0.05)


def _slow_forward(engine: Any, seconds: float) -> None:
    """Make this rank's forward passes need ``seconds`` more work per step, like a slower
    device: a busy loop on the training thread (its CPU time, which is what a CPU rank's own
    compute measures; on an idle core, the same in wall time), before the rank joins the
    gradient sync. Installed once per module (a new layout builds a new one, or keeps a
    survivor's module, which then has it already: elastic/parallel/live.py)."""
    module = engine.module
    module._slow_per_micro_batch = seconds / max(1, getattr(engine, "grad_accum", 1))  # this layout's
    if getattr(module, "_injected_slow", None) == seconds:
        return

    def burn(m: Any, args: Any) -> None:
        end = time.thread_time() + m._slow_per_micro_batch
        while time.thread_time() < end:
            pass

    module.register_forward_pre_hook(burn)
    module._injected_slow = seconds


def _kill_quietly(pid: int | None) -> None:
    if pid is not None:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def flip_bit(tensor: Any, bit: int, index: int = 0) -> None:
    """Flip bit ``bit`` of element ``index`` of a tensor in place: silent data corruption on
    one rank (bit 30 of a float32 is the top exponent bit: a small weight becomes ~1e38)."""
    import torch

    flat = tensor.view(-1)
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
    word = flat[index : index + 1].view(ints)
    word.bitwise_xor_(torch.tensor(1 << bit, dtype=torch.int64).to(ints))


# --------------------------------------------------------------------------- driver side


@dataclass
class Fault:
    """A driver-side fault fired after step ``at_step`` completes.

    With ``during_recovery=n`` it fires instead inside the n-th failure's recovery, after
    the survivors were chosen and before they re-rendezvous: a loss mid-reconfiguration.
    """

    kind: str  # kill_worker | stop_worker | kill_node | drain
    at_step: int = 0
    during_recovery: int | None = None
    rank: int | None = None  # kill_worker / stop_worker: the rank at that moment
    node_index: int | None = None  # kill_node: index into the cluster's worker nodes (else the node of ``rank``)
    return_after_s: float | None = None  # kill_node: add an equal node back after this delay
    graceful_raylet: bool = False  # kill_node: SIGTERM the node's raylet instead of SIGKILL (quieter logs)
    delay_s: float = 0.0  # during_recovery: fire this long after the re-rendezvous starts (from a thread)
    deadline_s: float = DRAIN_DEADLINE_S  # drain: the notice given before the node is reclaimed
    fired_at: float | None = field(default=None, init=False)


class FaultInjector(Callback):
    """Controller callback that fires driver-side faults with real signals."""

    def __init__(self, faults: list[Fault], cluster: Any = None, node_args: dict[str, Any] | None = None):
        self.faults = list(faults)
        self.cluster = cluster
        self.node_args = node_args or {}
        self.returned_nodes: list[Any] = []
        self._stopped_pids: list[int] = []
        self._due: list[float] = []  # monotonic times at which to add a node back
        self._reclaims: list[tuple[float, Any]] = []  # (monotonic deadline, node) of drained nodes
        self.drained: list[tuple[float, str]] = []  # (wall time, node id) of each drain request
        self._next_members: Sequence[Any] | None = None  # during before_reconfigure: the layout to come

    def after_step(self, step: int, group: Any) -> None:
        self._reclaim_due_nodes(group)
        self._return_due_nodes()
        for fault in self.faults:
            if fault.fired_at is None and fault.during_recovery is None and step >= fault.at_step:
                self._fire(fault, group)

    def before_reconfigure(self, recovery: int, group: Any, members: Sequence[Any]) -> None:
        """``rank`` in a fault fired here is a rank of the layout about to be configured."""
        for fault in self.faults:
            if fault.fired_at is None and fault.during_recovery == recovery:
                self._next_members = members
                try:
                    if fault.delay_s > 0:  # resolve the target now, kill it once the rendezvous runs
                        pid = self._pid(fault, group)
                        fault.fired_at = time.time()
                        threading.Timer(fault.delay_s, _kill_quietly, (pid,)).start()
                    else:
                        self._fire(fault, group)
                finally:
                    self._next_members = None

    def _fire(self, fault: Fault, group: Any) -> None:
        fault.fired_at = time.time()
        getattr(self, f"_{fault.kind}")(fault, group)

    def _kill_worker(self, fault: Fault, group: Any) -> None:
        pid = self._pid(fault, group)
        if pid is not None:
            os.kill(pid, signal.SIGKILL)

    def _stop_worker(self, fault: Fault, group: Any) -> None:
        pid = self._pid(fault, group)
        if pid is not None:
            self._stopped_pids.append(pid)
            os.kill(pid, signal.SIGSTOP)

    def _pid(self, fault: Fault, group: Any) -> int | None:
        """The pid of ``fault.rank`` now (in a recovery: of the layout to come), or None
        (with a warning) when the job has no such rank at this moment (it shrank) or the
        worker is not on this machine."""
        members = getattr(group, "members", None)
        if self._next_members is not None:
            ranked = list(enumerate(self._next_members))
        else:
            ranked = [(m.rank, m) for m in members or []]
        member = (
            None
            if members is None
            else next((m for r, m in ranked if r == fault.rank and not getattr(m, "dead", False)), None)
        )
        if members is not None and member is None:
            log.warning("fault %s@%d: no rank %s at this step; not fired", fault.kind, fault.at_step, fault.rank)
            return None
        ip = getattr(member, "ip", None)
        if ip and not _is_local(ip):
            log.warning(
                "fault %s@%d: rank %s runs on %s, not on this machine; not fired",
                fault.kind,
                fault.at_step,
                fault.rank,
                ip,
            )
            return None
        return member.pid if member is not None else group.pid_of(fault.rank)

    def _node_index(self, fault: Fault, group: Any) -> int | None:
        index = fault.node_index
        if index is None:  # the node hosting ``fault.rank``
            members = self._next_members or sorted(group.members, key=lambda m: m.rank)
            host = members[fault.rank].node_id
            index = next(i for i, n in enumerate(worker_nodes(self.cluster)) if n.node_id == host)
        if index >= len(worker_nodes(self.cluster)):
            log.warning("fault %s@%d: no worker node %d left; not fired", fault.kind, fault.at_step, index)
            return None
        return index

    def _drain(self, fault: Fault, group: Any) -> Any:
        """Ray's own drain (a preemption notice with a deadline); the node is reclaimed at the deadline."""
        index = self._node_index(fault, group)
        if index is None:
            return None
        node = worker_nodes(self.cluster)[index]
        drain_node(node.node_id, fault.deadline_s, message=f"elastic fault drain@{fault.at_step}")
        self.drained.append((time.time(), node.node_id))
        self._reclaims.append((time.monotonic() + fault.deadline_s, node))
        if fault.return_after_s is not None:
            self._due.append(time.monotonic() + fault.return_after_s)
        return node

    def _reclaim_due_nodes(self, group: Any) -> None:
        """A drained node still there at its deadline is killed, as a cloud reclaims it."""
        now = time.monotonic()
        for item in [r for r in self._reclaims if r[0] <= now]:
            self._reclaims.remove(item)
            nodes = worker_nodes(self.cluster)
            if item[1] in nodes:
                kill_node(self.cluster, nodes.index(item[1]), group, graceful_raylet=True)

    def _kill_node(self, fault: Fault, group: Any) -> None:
        index = self._node_index(fault, group)
        if index is None:
            return None
        node = kill_node(self.cluster, index, group, graceful_raylet=fault.graceful_raylet)
        if fault.return_after_s is not None:
            self._due.append(time.monotonic() + fault.return_after_s)
        return node

    def _return_due_nodes(self) -> None:
        """Add nodes back once due. Ray's ``add_node`` must run on the main thread, which is
        where the controller calls its callbacks."""
        now = time.monotonic()
        for due in [d for d in self._due if d <= now]:
            self._due.remove(due)
            self.returned_nodes.append(self.cluster.add_node(**self.node_args))

    def close(self) -> None:
        for pid in self._stopped_pids:  # never leave a stopped process behind
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass


def kill_node(cluster: Any, node_index: int, group: Any = None, graceful_raylet: bool = False) -> Any:
    """SIGKILL every worker process on a worker node, then remove the node from the cluster.

    Removing the node alone would leave its worker processes alive (see "kill_node" in ``docs/faults.md``).
    """
    node = worker_nodes(cluster)[node_index]
    node_id = node.node_id
    pids = set(group.pids_on_node(node_id)) if group is not None else set()
    # Every worker process of the node is a child of its raylet. (Ray's state API would
    # also list them, but it can block for 30 s when the dashboard is busy.)
    for info in node.all_processes.get("raylet", []):
        pids |= _children(info.process.pid)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    cluster.remove_node(node, allow_graceful=graceful_raylet)
    return node


def drain_node(node_id: str, deadline_s: float | None, reason: str = "preemption", message: str = "") -> None:
    """Ask Ray to drain ``node_id`` (``ray drain-node``'s API, the one autoscaler v2 uses).

    ``reason``: ``preemption`` or ``idle_termination``. Ray does not kill the node at the
    deadline: the caller does (``FaultInjector`` reclaims it).
    """
    import ray
    from ray.core.generated import autoscaler_pb2

    reasons = {
        "preemption": autoscaler_pb2.DRAIN_NODE_REASON_PREEMPTION,
        "idle_termination": autoscaler_pb2.DRAIN_NODE_REASON_IDLE_TERMINATION,
    }
    deadline_ms = 0 if deadline_s is None else int(time.time() * 1000 + deadline_s * 1000)
    gcs = ray._private.worker.global_worker.gcs_client
    accepted, why = gcs.drain_node(node_id, reasons[reason], message or f"drain {reason}", deadline_ms)
    if not accepted:
        raise RuntimeError(f"Ray did not accept the drain of node {node_id}: {why}")


def _is_local(ip: str) -> bool:
    """Whether ``ip`` is an address of this machine (signals only reach local processes)."""
    if ip.startswith("127.") or ip in ("::1", "localhost"):
        return True
    try:
        import ray

        if ip == ray.util.get_node_ip_address():
            return True
    except Exception:  # noqa: BLE001 - no Ray connection: fall back on the host's names
        pass
    try:
        return ip in socket.gethostbyname_ex(socket.gethostname())[2]
    except OSError:
        return False


def _children(parent: int) -> set[int]:
    """Pids of ``parent``'s child processes (Linux procfs)."""
    out = set()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == parent:  # fields after the command: state, ppid, ...
            out.add(int(name))
    return out


def worker_nodes(cluster: Any) -> list[Any]:
    return [n for n in cluster.list_all_nodes() if n is not cluster.head_node]


# --------------------------------------------------------------------------- from the command line

# Keys each kind accepts, with their types. ``rank`` is the rank at the moment the fault fires.
FAULT_KEYS: dict[str, dict[str, type]] = {
    "kill_worker": {"rank": int},
    "stop_worker": {"rank": int},
    "kill_node": {"node": int, "rank": int, "return_after_s": float},
    "drain": {"node": int, "rank": int, "deadline_s": float, "return_after_s": float},
    "nan": {"rank": int},
    "spike": {"rank": int},
    "raise": {"rank": int},
    "hang": {"rank": int, "seconds": float},
    "slow": {"rank": int, "seconds": float},
    "bitflip": {"rank": int, "bit": int},
}
FAULT_SYNTAX = "KIND@STEP[:key=value...]"


@dataclass(frozen=True)
class FaultSpec:
    """One ``--fault KIND@STEP[:key=value...]`` of ``elastic run``, parsed (not yet checked
    against a job: see ``check_fault_specs``)."""

    kind: str
    step: int
    options: dict[str, Any]
    text: str

    def get(self, key: str, default: Any = None) -> Any:
        return self.options.get(key, default)


def _bad(text: str, why: str) -> Exception:
    from elastic.errors import SpecError

    return SpecError("--fault", f"{text!r}: {why}")


def parse_fault_spec(text: str) -> FaultSpec:
    """Parse ``KIND@STEP[:key=value...]``; raises ``SpecError('--fault', ...)`` on bad input."""
    head, *pairs = text.strip().split(":")
    kind, at, step_text = head.partition("@")
    kind = kind.strip()
    if kind not in FAULT_KINDS:
        raise _bad(text, f"unknown kind {kind!r}; expected {FAULT_SYNTAX} with KIND one of {', '.join(FAULT_KINDS)}")
    if not at:
        raise _bad(text, f"missing @STEP; expected {FAULT_SYNTAX}")
    try:
        step = int(step_text)
    except ValueError:
        raise _bad(text, f"step {step_text!r} is not an integer") from None
    if step < 1:
        raise _bad(text, f"step must be >= 1 (got {step})")
    allowed = FAULT_KEYS[kind]
    options: dict[str, Any] = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        key = key.strip()
        if not eq or not key:
            raise _bad(text, f"expected key=value, got {pair!r}")
        if key not in allowed:
            raise _bad(text, f"unknown key {key!r} for {kind}; allowed: {', '.join(allowed) or 'none'}")
        if key in options:
            raise _bad(text, f"key {key!r} given twice")
        try:
            parsed = allowed[key](value.strip())
        except ValueError:
            raise _bad(text, f"{key}={value!r} is not {'an integer' if allowed[key] is int else 'a number'}") from None
        if parsed < 0 or parsed != parsed or parsed == float("inf"):
            raise _bad(text, f"{key} must be >= 0 and finite (got {value})")
        options[key] = parsed
    if kind == "bitflip" and not 0 <= options.get("bit", 30) <= 31:
        raise _bad(text, f"bit must be in 0..31 (float32 weights), got {options['bit']}")
    if kind in ("kill_node", "drain") and "node" in options and "rank" in options:
        raise _bad(text, "give node or rank, not both")
    return FaultSpec(kind, step, options, text)


def check_fault_specs(faults: list[FaultSpec], spec: Any) -> None:
    """Check parsed faults against a job spec: steps within ``train.steps``, ranks and nodes
    within the largest layout (``max_dp`` replicas; the embedded multi-node cluster has one
    node per worker)."""
    world = spec.elastic.max_dp * spec.parallel.replica_size
    for f in faults:
        if f.step > spec.train.steps:
            raise _bad(
                f.text, f"step {f.step} is after the last step (train.steps={spec.train.steps}): it would never fire"
            )
        for key in ("rank", "node"):
            if key in f.options and f.options[key] >= world:
                raise _bad(
                    f.text,
                    f"{key} {f.options[key]} out of range: the job has at most {world} "
                    f"{'workers' if key == 'rank' else 'worker nodes'} (0..{world - 1})",
                )


def build_faults(faults: list[FaultSpec], spec: Any) -> tuple[list[Fault], list[dict[str, Any]]]:
    """Driver-side ``Fault``s (for a ``FaultInjector``) and worker-side fault dicts."""
    driver, worker = [], []
    hang_s = 2 * spec.elastic.collective_timeout_s + spec.elastic.heartbeat_timeout_s  # well past any timeout
    for f in faults:
        if f.kind in DRIVER_FAULT_KINDS:
            node = f.get("node")
            on_node = f.kind in ("kill_node", "drain")
            if on_node and node is None and f.get("rank") is None:
                node = spec.elastic.max_dp * spec.parallel.replica_size - 1  # the last worker node
            driver.append(
                Fault(
                    f.kind,
                    at_step=f.step,
                    rank=f.get("rank", None if on_node else 0),
                    node_index=node if on_node else None,
                    return_after_s=f.get("return_after_s"),
                    graceful_raylet=on_node,
                    deadline_s=f.get("deadline_s", DRAIN_DEADLINE_S),
                )
            )
        else:
            seconds = f.get("seconds", hang_s if f.kind == "hang" else 0.5 if f.kind == "slow" else 0.0)
            worker.append(worker_fault(f.kind, f.step, rank=f.get("rank", 0), seconds=seconds, bit=f.get("bit", 30)))
    return driver, worker
