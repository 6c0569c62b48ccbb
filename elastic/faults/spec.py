"""``--fault KIND@STEP[:key=value...]`` of ``elastic run`` and ``python -m jobs.train``:
parsed, checked against the job spec, and turned into driver-side ``Fault``s and
worker-side fault dicts. Runs in the driver, before anything starts (bad input: a
``SpecError`` naming ``--fault``, exit 2)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from elastic.faults.driver import DRAIN_DEADLINE_S, DRIVER_FAULT_KINDS, Fault
from elastic.faults.worker import worker_fault

FAULT_KINDS = ("kill_worker", "kill_node", "stop_worker", "nan", "spike", "raise", "hang", "slow", "bitflip", "drain")

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
        if f.kind in DRIVER_FAULT_KINDS and f.step == spec.train.steps:  # fires once its step has completed
            raise _bad(
                f.text,
                f"{f.kind} fires once step {f.step} has completed, and the job ends there "
                f"(train.steps={spec.train.steps}): it would never fire; choose a step before the last",
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
