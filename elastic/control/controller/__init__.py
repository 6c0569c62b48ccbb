"""The elastic controller: an explicit state machine that drives a run, in the driver.

One class, ``Controller``, in three files by concern: ``machine.py`` (the main loop, its
states' handlers, notices and a graceful stop), ``steps.py`` (reports and committed steps,
rollbacks in place) and ``reforms.py`` (recoveries and resizes). Nothing outside this
package changes a controller field: its inputs (health, drain, stop) return intents, its
decisions are pure functions (``policies.py``, ``recovery_plan.py``) and the effects on
the worker group are carried out by ``reform.py``.
"""

from elastic.control.controller.controller import Controller
from elastic.control.controller.states import Failed, Finished, Recovering, Resizing, Running, Starting, State

__all__ = ["Controller", "Failed", "Finished", "Recovering", "Resizing", "Running", "Starting", "State"]
