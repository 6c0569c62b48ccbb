"""The real worker group and the controller tests' fake both implement ``WorkerGroupAPI``."""

from __future__ import annotations

import inspect

import pytest
from elastic_testlib import elastic_spec
from fake_group import FakeWorkerGroup

from elastic.control.worker_group import WorkerGroup
from elastic.control.worker_group.api import WorkerGroupAPI

pytestmark = pytest.mark.timeout(30)

METHODS = [name for name, value in vars(WorkerGroupAPI).items() if callable(value) and not name.startswith("_")]


@pytest.mark.parametrize("cls", [WorkerGroup, FakeWorkerGroup], ids=["real", "fake"])
def test_group_implements_the_protocol(cls):
    group = cls(elastic_spec(), "memory://corpus", step_hook=None, storage_uri="")  # no Ray call until spawn
    assert isinstance(group, WorkerGroupAPI)
    for name in METHODS:
        want = inspect.signature(getattr(WorkerGroupAPI, name))
        got = inspect.signature(getattr(cls, name))
        assert list(got.parameters) == list(want.parameters), (cls.__name__, name, got, want)


def test_protocol_lists_what_the_controller_calls():
    """Every ``group.X(`` the controller package and ``reform.py`` make is in the Protocol."""
    import re

    from elastic.control import reform
    from elastic.control.controller import controller

    source = "".join(inspect.getsource(m) for m in (controller, reform))
    called = set(re.findall(r"group\.(\w+)\(", source))
    assert called, "the check found no call at all"
    assert called <= set(METHODS), called - set(METHODS)
    assert called >= {"reform", "spawn", "observe", "kill", "snapshot_holdings", "draining_nodes"}
