"""Node agents and aggregators: the control plane between the driver and the ranks.

One ``NodeAgent`` actor per node (``actors.py``) owns the liveness, the polling and the
report collection of the ranks on its node, and carries the driver's commands to them
(``node.py``). ``Aggregator`` actors merge the digests of a bounded number of agents (or of
aggregators) into one, so the driver's fan-in per step is the number of top-level channels,
not of ranks or nodes (``aggregator.py``; the tree's shape: ``elastic/control/agent_link.py``).
For a few nodes the aggregator tier collapses and the driver talks to the agents.

Where it runs: agents on their nodes, aggregators on the driver's node, each in its own Ray
actor process; none imports ``elastic.control`` (the driver's side is
``elastic/control/agent_link.py``), and ranks (``elastic/worker/``) know the agent only
through the messages in ``elastic/messages.py``. See docs/architecture.md.
"""
