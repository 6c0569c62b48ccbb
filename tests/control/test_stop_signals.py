"""The driver's SIGINT/SIGTERM handling (``elastic/control/stop.py``), in this process with real
signals, and the ``drain`` fault's parsing. No Ray: the graceful stop of a real job is in
tests/control/test_stop_drain.py."""

from __future__ import annotations

import os
import signal
import time

import pytest

from elastic.control.stop import StopNow, StopSignals, exit_code_of, stop_now_in
from elastic.events import RunResult
from elastic.faults import build_faults, parse_fault_spec
from jobs import JobSpec

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def signals():
    s = StopSignals(grace_s=30.0)
    assert s.install()
    yield s
    s.uninstall()


def _deliver(sig: int) -> None:
    os.kill(os.getpid(), sig)
    time.sleep(0.01)  # the handler runs in the main thread at the next bytecode


@pytest.mark.parametrize(("sig", "code", "name"), [(signal.SIGTERM, 143, "SIGTERM"), (signal.SIGINT, 130, "SIGINT")])
def test_first_signal_only_records(signals, sig, code, name):
    _deliver(sig)  # does not raise: the controller acts on it at its next look
    assert signals.requested and signals.signal_name == name and signals.exit_code == code
    assert 29.0 < signals.remaining_s() <= 30.0


def test_second_signal_stops_at_once(signals):
    _deliver(signal.SIGTERM)
    with pytest.raises(StopNow, match="second signal"):
        _deliver(signal.SIGINT)


def test_grace_expiry_interrupts_the_main_thread():
    s = StopSignals(grace_s=0.2)
    s.install()
    try:
        t0 = time.monotonic()
        with pytest.raises(StopNow, match="stop_grace_s=0.2s"):
            _deliver(signal.SIGTERM)
            while time.monotonic() - t0 < 10:
                time.sleep(0.01)
        assert time.monotonic() - t0 < 5
    finally:
        s.uninstall()


def test_no_expiry_past_the_boundary():
    s = StopSignals(grace_s=0.1)
    s.install()
    try:
        _deliver(signal.SIGTERM)
        s.past_boundary()
        time.sleep(0.3)  # the grace timer was cancelled: nothing is raised
        assert not s.grace_expired
    finally:
        s.uninstall()


def test_uninstall_restores_previous_handlers():
    before = signal.getsignal(signal.SIGTERM)
    s = StopSignals(grace_s=1.0)
    s.install()
    assert signal.getsignal(signal.SIGTERM) != before
    s.uninstall()
    assert signal.getsignal(signal.SIGTERM) == before


def test_stop_now_is_found_behind_a_wrapper():
    try:
        try:
            raise StopNow("second signal")
        except StopNow as inner:
            raise SystemError("returned a result with an exception set") from inner
    except SystemError as outer:
        assert stop_now_in(outer).reason == "second signal"
    assert stop_now_in(ValueError("x")) is None


def test_exit_codes_of_stopped_results():
    def result(sig):
        return RunResult(status="stopped", steps=3, final_loss=1.0, wall_s=1, mean_tokens_per_s=1, failures=0,
                         stop={"signal": sig, "checkpoint_step": 3, "stop_reason": "x"})  # fmt: skip

    assert exit_code_of(result("SIGINT")) == 130
    assert exit_code_of(result("SIGTERM")) == 143


def test_drain_fault_builds_a_driver_fault():
    spec = JobSpec.from_dict({"name": "t", "train": {"steps": 40, "global_batch": 8}, "parallel": {"micro_batch": 2}})
    driver, worker = build_faults([parse_fault_spec("drain@12:node=2:deadline_s=20")], spec)
    assert worker == [] and len(driver) == 1
    f = driver[0]
    assert (f.kind, f.at_step, f.node_index, f.deadline_s) == ("drain", 12, 2, 20.0)
    default = build_faults([parse_fault_spec("drain@5")], spec)[0][0]
    assert default.deadline_s == 30.0 and default.node_index == spec.elastic.max_dp - 1


def test_stop_grace_s_is_a_spec_key():
    spec = JobSpec.from_dict({"name": "t", "elastic": {"stop_grace_s": 5}})
    assert spec.elastic.stop_grace_s == 5.0
    assert JobSpec.from_dict({"name": "t"}).elastic.stop_grace_s == 30.0
