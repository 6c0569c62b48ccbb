"""The elastic controller: an explicit state machine that drives a run, in the driver.

One class, ``Controller``, in one file (``controller.py``), its states beside it
(``states.py``). Nothing outside this package changes a controller field: its inputs
(health, drain, stop) return intents, its decisions are pure functions (``policies.py``,
``recovery_plan.py``) and the effects on the worker group are carried out by ``reform.py``.
"""

from elastic.control.controller.controller import Controller
from elastic.control.controller.states import Failed, Finished, Recovering, Resizing, Running, Starting, State

__all__ = ["Controller", "Failed", "Finished", "Recovering", "Resizing", "Running", "Starting", "State"]
