"""``elastic run --fault KIND@STEP[:key=value...]``: the parser (pure) and the CLI's refusals.

A fault that actually fires through the CLI is tested in tests/control/test_failures_local.py.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from cli_testlib import run_cli

from elastic.errors import SpecError
from elastic.faults import FAULT_KINDS, Fault, build_faults, check_fault_specs, flip_bit, parse_fault_spec
from jobs import JobSpec

pytestmark = pytest.mark.timeout(120)

QUICKSTART = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "quickstart.yaml")

GOOD = {
    "kill_worker@20:rank=2": ("kill_worker", 20, {"rank": 2}),
    "kill_node@30:node=1:return_after_s=8": ("kill_node", 30, {"node": 1, "return_after_s": 8.0}),
    "stop_worker@15:rank=1": ("stop_worker", 15, {"rank": 1}),
    "nan@12:rank=0": ("nan", 12, {"rank": 0}),
    "spike@12": ("spike", 12, {}),
    "raise@10:rank=3": ("raise", 10, {"rank": 3}),
    "hang@10:rank=1": ("hang", 10, {"rank": 1}),
    "slow@5:rank=2:seconds=0.3": ("slow", 5, {"rank": 2, "seconds": 0.3}),
    "bitflip@7:rank=1:bit=29": ("bitflip", 7, {"rank": 1, "bit": 29}),
    "drain@12:node=3:deadline_s=30": ("drain", 12, {"node": 3, "deadline_s": 30.0}),
}

BAD = [
    ("boom@3", "unknown kind 'boom'"),
    ("kill_worker", "missing @STEP"),
    ("kill_worker@x", "step 'x' is not an integer"),
    ("kill_worker@0", "step must be >= 1"),
    ("kill_worker@-2", "step must be >= 1"),
    ("kill_worker@3:node=1", "unknown key 'node' for kill_worker"),
    ("spike@3:seconds=1", "unknown key 'seconds' for spike"),
    ("kill_worker@3:rank=a", "rank='a' is not an integer"),
    ("kill_worker@3:rank", "expected key=value"),
    ("kill_worker@3:rank=1:rank=2", "given twice"),
    ("slow@3:seconds=-1", "seconds must be >= 0"),
    ("slow@3:seconds=nan", "seconds must be >= 0 and finite"),
    ("bitflip@3:bit=32", "bit must be in 0..31"),
    ("kill_node@3:node=1:rank=1", "node or rank, not both"),
]


@pytest.mark.parametrize("text", list(GOOD))
def test_parses_every_kind(text):
    f = parse_fault_spec(text)
    assert (f.kind, f.step, f.options) == GOOD[text]
    assert {parse_fault_spec(t).kind for t in GOOD} == set(FAULT_KINDS)


@pytest.mark.parametrize("text,why", BAD, ids=[t for t, _ in BAD])
def test_bad_spec_names_the_flag(text, why):
    with pytest.raises(SpecError) as info:
        parse_fault_spec(text)
    assert info.value.field == "--fault" and why in str(info.value) and "\n" not in str(info.value)


def test_checked_against_the_job():
    spec = JobSpec.from_yaml(QUICKSTART, overrides=["train.steps=40", "elastic.max_dp=2", "train.global_batch=8"])
    ok = ("kill_worker@39:rank=1", "kill_node@3:node=1", "raise@40:rank=1")  # raise: inside step 40
    check_fault_specs([parse_fault_spec(t) for t in ok], spec)
    for text, why in [
        ("kill_worker@41:rank=0", "after the last step"),
        # a kill fires once its step has completed: at the last one the job has ended (it never fired)
        ("kill_worker@40:rank=1", "kill_worker fires once step 40 has completed, and the job ends there"),
        ("stop_worker@40", "stop_worker fires once step 40 has completed"),
        ("raise@3:rank=2", "rank 2 out of range"),
        ("kill_node@3:node=2", "node 2 out of range"),
    ]:
        with pytest.raises(SpecError, match=why):
            check_fault_specs([parse_fault_spec(text)], spec)


def test_builds_driver_and_worker_faults():
    spec = JobSpec.from_yaml(QUICKSTART)  # max_dp 4, collective_timeout_s 30, heartbeat 10
    texts = [
        "kill_worker@20:rank=2",
        "kill_node@30:node=1:return_after_s=8",
        "kill_node@31",
        "stop_worker@15",
        "hang@10:rank=1",
        "slow@5:rank=2:seconds=0.3",
        "bitflip@4:rank=3",
        "spike@12",
    ]
    driver, worker = build_faults([parse_fault_spec(t) for t in texts], spec)
    assert [(f.kind, f.at_step, f.rank, f.node_index, f.return_after_s) for f in driver] == [
        ("kill_worker", 20, 2, None, None),
        ("kill_node", 30, None, 1, 8.0),
        ("kill_node", 31, None, 3, None),
        ("stop_worker", 15, 0, None, None),
    ]
    assert all(isinstance(f, Fault) for f in driver)
    assert [(w["kind"], w["step"], w["rank"]) for w in worker] == [
        ("hang", 10, 1),
        ("slow", 5, 2),
        ("bitflip", 4, 3),
        ("spike", 12, 0),
    ]
    assert worker[0]["seconds"] == 70.0  # past both timeouts: a hang the controller must detect
    assert worker[1]["seconds"] == 0.3 and worker[2]["bit"] == 30


def test_flip_bit_flips_exactly_one_bit():
    t = torch.full((3, 4), 0.02)
    before = t.clone()
    flip_bit(t, 30)
    assert t[0, 0].item() > 1e30 and torch.equal(t.view(-1)[1:], before.view(-1)[1:])
    flip_bit(t, 30)
    assert torch.equal(t, before)
    flip_bit(t, 0)  # the lowest mantissa bit: a silent, tiny change
    assert t[0, 0].item() != 0.02 and abs(t[0, 0].item() - 0.02) < 1e-8


def _cli(*args: str, module: str = "jobs.cli") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=60)


def test_cli_refuses_bad_faults_with_one_line(capsys):
    cases = [
        (("run", QUICKSTART, "--fault", "boom@3"), "unknown kind"),
        (("run", QUICKSTART, "--fault", "kill_worker@3:rank=9"), "rank 9 out of range"),
        (("run", QUICKSTART, "--fault", "kill_worker@5", "--fault", "nan@500"), "after the last step"),
        (("run", QUICKSTART, "--fault", "kill_node@3", "--address", "127.0.0.1:1"), "embedded multi-node cluster"),
    ]
    for i, (args, why) in enumerate(cases):
        proc = _cli(*args) if i == 0 else run_cli(capsys, *args)  # the console entry once
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1, proc.stderr
        assert lines[0].startswith("error: --fault: ") and why in lines[0], proc.stderr
    # The Ray Jobs entry takes the same flag.
    proc = _cli(QUICKSTART, "--fault", "slow@2:rank=1:seconds=fast", module="jobs.train")
    assert proc.returncode == 2 and "--fault" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_a_one_shot_fault_fires_once_and_not_in_a_survivor_replaying_its_step():
    """A worker that began step 3 as rank 2 and replays it as rank 1 after a recovery (a
    survivor renumbered onto the faulted rank) runs it clean; the worker that was rank 1 at
    its first step 3 gets the fault, once."""
    from elastic.faults import WorkerFaults, worker_fault
    from elastic.faults.worker import InjectedError

    survivor = WorkerFaults([worker_fault("raise", step=3, rank=1)])
    for step in (1, 2, 3):
        survivor.before_step(step, 2, engine=None)
    survivor.before_step(3, 1, engine=None)  # the replay: no raise
    survivor.before_step(4, 1, engine=None)
    faulted = WorkerFaults([worker_fault("raise", step=3, rank=1)])
    faulted.before_step(2, 1, engine=None)
    with pytest.raises(InjectedError):
        faulted.before_step(3, 1, engine=None)
    faulted.before_step(3, 1, engine=None)  # once


def test_a_fault_below_a_dp_fires_in_the_first_step_of_a_smaller_run_replayed_or_not():
    """``below_dp``: nothing at dp 4; at the first step from ``step`` on at dp 3 (here step 9
    again, a replay after a shrink) it fires in the worker that is ``rank`` then, and every
    other worker drops it (it fires once)."""
    from types import SimpleNamespace

    from elastic.faults import WorkerFaults, worker_fault
    from elastic.faults.worker import InjectedError

    at = {dp: SimpleNamespace(dims=SimpleNamespace(dp=dp)) for dp in (3, 4)}
    faulted, other = (WorkerFaults([worker_fault("raise", step=8, rank=1, below_dp=4)]) for _ in range(2))
    for step in range(1, 10):
        faulted.before_step(step, 1, at[4])
        other.before_step(step, 2, at[4])
    assert faulted.pending(9, 1) and not faulted.pending(7, 1)
    with pytest.raises(InjectedError):
        faulted.before_step(9, 1, at[3])
    other.before_step(9, 0, at[3])  # not rank 1 there: dropped, not fired
    for worker in (faulted, other):
        worker.before_step(9, 1, at[3])  # the next generation replays step 9 clean
    with pytest.raises(ValueError):
        worker_fault("raise", step=8, rank=1, marker="x")
