"""Where ranks go: the cluster topology, the topology-aware planner, and the placement groups
that carry its plan out."""
