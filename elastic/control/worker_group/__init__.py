"""The worker group: the Ray-effectful half of the controller, one type per file (in the
manner of Ray Train V2's ``worker_group/``): ``group.py`` (``WorkerGroup``), ``state.py``
(its members and their indexes), ``poll.py`` (what a look at the agent tree brings and the
commands sent down it), ``worker.py`` (one member), ``configure.py`` (carrying a
``ReformPlan`` out), ``api.py`` (the ``WorkerGroupAPI`` protocol the controller uses).
"""

from elastic.control.worker_group.group import WorkerGroup
from elastic.control.worker_group.worker import Member

__all__ = ["Member", "WorkerGroup"]
