"""Discrete-event failure simulator (docs/simulate.md), run in the driver's process by
``elastic simulate``: the names of the model in one place.

Two layers:

* **The cluster** (``cluster.py``: ``Job``, ``Scenario``, ``cluster_events``), exogenous,
  the same for every strategy, so strategies and checkpoint intervals are compared on the
  same failures.
* **The job's reaction** (``reaction.py``: ``Reaction``), from the project's own policies
  and placement planner.

``run.py`` plays one strategy over one history (``simulate``, ``best_interval``).
"""

from __future__ import annotations

from elastic.simulator.cluster import DAY, Event, Job, Scenario, cluster_events
from elastic.simulator.reaction import Reaction
from elastic.simulator.run import (
    Result,
    best_interval,
    closed_form_ettr,
    dp_at,
    effective_interval,
    interval_grid,
    simulate,
    strategy_costs,
)

__all__ = [
    "DAY",
    "Event",
    "Job",
    "Reaction",
    "Result",
    "Scenario",
    "best_interval",
    "closed_form_ettr",
    "cluster_events",
    "dp_at",
    "effective_interval",
    "interval_grid",
    "simulate",
    "strategy_costs",
]
