"""``elastic simulate``: a discrete-event failure simulator driven by the project's own
policies and planner, with costs measured here or cited (docs/simulate.md)."""
