"""The agent's way to real ranks: Ray actor calls to ``TrainWorker``s (``node.RankBackend``).

Where it runs: in the ``NodeAgent`` actor. One ``ray.wait`` covers every call in flight, and
the agent's doorbell (``bell.py``), so that a command's new calls are waited on at once.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import ray
from ray.exceptions import ActorUnavailableError, GetTimeoutError, OutOfDiskError, OutOfMemoryError, RayActorError

from elastic.agent.bell import Doorbell
from elastic.errors import cause_chain, root_cause
from elastic.messages import RankCall, rank_call_args


class ActorRanks:
    def __init__(self, bell: Doorbell):
        self.bell = bell

    def call(self, handle: Any, call: RankCall) -> Any:
        return getattr(handle, call.method).remote(*rank_call_args(call))

    def wait(self, futures: list[Any], timeout_s: float) -> list[Any]:
        return self.bell.wait(futures, timeout_s)

    def result(self, future: Any) -> tuple[str, Any]:
        try:
            return "ok", ray.get(future, timeout=0)
        except ActorUnavailableError:  # unreachable for now: silence counts, death is confirmed later
            return "unavailable", None
        except (RayActorError, OutOfMemoryError):  # (killed by Ray's memory monitor: gone as well)
            return "dead", None
        except GetTimeoutError:
            return "unavailable", None
        except Exception as exc:  # noqa: BLE001 - the rank's own error, named by its root cause
            return ("node_fault" if node_fault(exc) else "error"), root_cause(exc)

    def wake(self) -> None:
        self.bell.ring()

    def end(self, pid: int) -> None:
        """SIGKILL the rank process ``pid`` if it is still one (a Ray worker: a pid may have
        been reused since its rank died)."""
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if pid <= 0 or not f.read().startswith(b"ray::"):
                    return
            os.kill(pid, signal.SIGKILL)
        except OSError:  # gone already, or no /proc here: Ray's own kill ends it
            pass


def node_fault(exc: BaseException) -> bool:
    """Did the call fail because of its node rather than the rank's code: Ray's full disk
    (``OutOfDiskError``), raised to the caller or inside the rank (a task error's cause)?"""
    return any(isinstance(e, OutOfDiskError) for e in cause_chain(exc))
