"""The control loop of a job: the driver-side controller, its states, its pure decisions
(policies, recovery planning, diagnosis), its timing, and its inputs (health, stop, drain)."""
