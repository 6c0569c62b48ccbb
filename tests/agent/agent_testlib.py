"""What the agent and tree unit tests share: a test clock and scripted ranks.

A ``ScriptedRanks`` backend stands for the Ray calls: every call is a future the test
answers (or lets die).
"""

from __future__ import annotations

from elastic.agent.node import NodeCore
from elastic.messages import Attach, RankCall, StepReport, rank_call_args


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class Future:
    def __init__(self, handle: str, call: RankCall):
        self.handle, self.call = handle, call
        self.args = rank_call_args(call)  # what Ray would send
        self.status: str | None = None
        self.value = None

    def answer(self, value=None, status: str = "ok") -> None:
        self.status, self.value = status, value


class ScriptedRanks:
    def __init__(self) -> None:
        self.calls: list[Future] = []
        self.ended: list[int] = []

    def call(self, handle, call):
        f = Future(handle, call)
        self.calls.append(f)
        return f

    def wait(self, futures, timeout_s):
        return [f for f in futures if f.status is not None]

    def result(self, f):
        return f.status, f.value

    def wake(self):
        pass

    def end(self, pid):
        self.ended.append(pid)

    def pending(self, handle: str, kind: type) -> list[Future]:
        return [f for f in self.calls if f.handle == handle and isinstance(f.call, kind) and f.status is None]


def report(step: int, compute: float = 1.0) -> StepReport:
    return StepReport(step, 2.5, 1.0, 0.1, step, 0, 1000.0 + step, compute_s=compute)


def node(ranks: int = 2):
    clock, backend = Clock(), ScriptedRanks()
    core = NodeCore("n0", backend, clock=clock)
    core.command(1, Attach({w: (f"r{w}", w) for w in range(ranks)}))
    core.pump(0)
    return core, backend, clock
