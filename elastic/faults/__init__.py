"""Fault injection: a tool of the project (``--fault``), used by the tests, the demo and the
benchmarks. Its parts, by where they run:

* ``worker.py``  inside a worker, at the start of a step: ``WorkerFaults`` (a ``StepHook``)
  and ``worker_fault`` (NaN, spike, bit flip, raise, hang, slow, hold); ``flip_bit``.
* ``driver.py``  in the driver, as a controller callback: ``FaultInjector`` fires ``Fault``s
  (kill or stop a worker, kill or drain a node) with real signals after a step.
* ``nodes.py``   in the driver, on a local ``ray.cluster_utils.Cluster``: ``kill_node``,
  ``drain_node``, ``worker_nodes``.
* ``spec.py``    ``--fault KIND@STEP[:key=value...]``: ``parse_fault_spec``,
  ``check_fault_specs``, ``build_faults``.

Every public name is importable from here (``from elastic.faults import FaultInjector``).
"""

from elastic.faults.driver import DRAIN_DEADLINE_S, DRIVER_FAULT_KINDS, Fault, FaultInjector
from elastic.faults.nodes import drain_node, kill_node, worker_nodes
from elastic.faults.spec import (
    FAULT_KEYS,
    FAULT_KINDS,
    FAULT_SYNTAX,
    FaultSpec,
    build_faults,
    check_fault_specs,
    parse_fault_spec,
)
from elastic.faults.worker import WORKER_FAULT_KINDS, InjectedError, WorkerFaults, flip_bit, worker_fault

__all__ = [
    "DRAIN_DEADLINE_S",
    "DRIVER_FAULT_KINDS",
    "FAULT_KEYS",
    "FAULT_KINDS",
    "FAULT_SYNTAX",
    "WORKER_FAULT_KINDS",
    "Fault",
    "FaultInjector",
    "FaultSpec",
    "InjectedError",
    "WorkerFaults",
    "build_faults",
    "check_fault_specs",
    "drain_node",
    "flip_bit",
    "kill_node",
    "parse_fault_spec",
    "worker_fault",
    "worker_nodes",
]
