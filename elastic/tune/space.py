"""Step 1 of a sweep: enumerate the parallel configurations and prune them (pure, no Ray).

A *space* maps the keys of ``parallel`` that a sweep varies (``SPACE_KEYS``) to lists of
candidate values. DP is not a key: for each layout it is the largest DP degree allowed by
``elastic.min_dp/max_dp`` and ``train.global_batch`` whose replicas fit the cluster's
worker slots, as in a run. Every configuration gets a status here: ``feasible`` (to be
measured), ``pruned_batch`` (the global batch or the topology rules it out) or
``pruned_memory`` (the memory model says it exceeds the budget). Format: docs/sweep.md.
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass, field
from typing import Any

from elastic.control import policies
from elastic.errors import SpecError
from elastic.parallel import batch
from elastic.parallel.memory_model import estimate_for_spec

SPACE_KEYS = ("tp", "pp", "ep", "cp", "zero", "shard_group", "micro_batch", "activation_checkpointing")
CONFIG_KEYS = (
    "dp",
    "tp",
    "pp",
    "ep",
    "cp",
    "zero",
    "shard_group",
    "micro_batch",
    "grad_accum",
    "activation_checkpointing",
)
GIB = 1 << 30


@dataclass(frozen=True)
class Cluster:
    """What the sweep can place: worker slots in all, and on the largest node."""

    worker_slots: int
    slots_per_node: int
    memory_per_worker_bytes: float
    device: str = "cpu"


@dataclass
class Candidate:
    config: dict[str, Any]  # CONFIG_KEYS; dp and grad_accum are None when no DP fits
    status: str  # feasible, pruned_batch or pruned_memory
    reason: str = ""
    predicted_mem_bytes: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return config_key(self.config)


def config_key(config: dict[str, Any]) -> str:
    c = config
    ac = "-ac" if c["activation_checkpointing"] else ""
    ep_cp = "".join(f"-{k}{c[k]}" for k in ("ep", "cp") if c.get(k, 1) > 1)  # names of before without them
    sg = f"-sg{c['shard_group']}" if c.get("shard_group") else ""  # HSDP
    return f"dp{c['dp']}-tp{c['tp']}-pp{c['pp']}{ep_cp}-z{c['zero']}{sg}-mb{c['micro_batch']}{ac}"


def parse_space(raw: Any, spec: Any) -> dict[str, list[Any]]:
    """Check a space mapping against the spec (a ``jobs.JobSpec``); every error names ``space.<key>``."""
    spec_raw = spec.model_dump(by_alias=True)
    if raw is None or raw == {}:
        raise SpecError("space", "is empty: list candidate values for at least one of " + ", ".join(SPACE_KEYS))
    if not isinstance(raw, dict):
        raise SpecError("space", "must be a mapping of key -> list of values")
    space: dict[str, list[Any]] = {}
    for key, values in raw.items():
        name = str(key).removeprefix("parallel.")
        if name not in SPACE_KEYS:
            hint = " (DP follows from the cluster and elastic.min_dp/max_dp)" if name == "dp" else ""
            raise SpecError(f"space.{key}", f"unknown key{hint}; expected one of {', '.join(SPACE_KEYS)}")
        values = values if isinstance(values, list) else [values]
        if not values:
            raise SpecError(f"space.{key}", "has no values")
        for v in values:
            trial = copy.deepcopy(spec_raw)
            trial.setdefault("parallel", {})[name] = v
            try:
                type(spec).from_dict(trial)
            except SpecError as exc:
                if exc.field.startswith("train.global_batch"):
                    continue  # reachability depends on the whole configuration: pruned_batch later
                if exc.field == "parallel.shard_group" and isinstance(v, int) and v >= 1:
                    continue  # it needs zero >= 1 and whole groups: judged per configuration later
                raise SpecError(f"space.{key}", f"value {v!r} is rejected: {exc}") from None
        space[name] = list(dict.fromkeys(values))
    return space


def default_space(spec: Any, cluster: Cluster) -> dict[str, list[Any]]:
    """A sensible space from the model and the cluster (used without ``--space``)."""
    m = spec.model
    tps = [t for t in (1, 2, 4, 8) if m.n_heads % t == 0 and t <= cluster.slots_per_node]
    pps = [p for p in (1, 2, 4) if p <= m.n_layers and p <= cluster.worker_slots]
    gb = spec.train.global_batch
    mbs = [b for b in (1, 2, 4, 8, 16) if gb % b == 0]
    space: dict[str, list[Any]] = {
        "tp": tps,
        "pp": pps,
        "zero": [0, 1, 3],
        "micro_batch": mbs,
        "activation_checkpointing": [False, True],
    }
    moe = getattr(m, "moe", None)
    if moe is not None:  # a mixture of experts: expert parallelism inside a node
        space["ep"] = [e for e in (1, 2, 4, 8) if moe.n_experts % e == 0 and e <= cluster.slots_per_node]
    return space


def enumerate_space(spec: Any, space: dict[str, list[Any]], cluster: Cluster, dtype_bytes: int = 4) -> list[Candidate]:
    """Every configuration of ``space`` (others from ``spec``), with its pruning status."""
    p = spec.parallel
    base = {k: getattr(p, k) for k in SPACE_KEYS}
    keys = list(SPACE_KEYS)
    out: list[Candidate] = []
    for values in itertools.product(*[space.get(k, [base[k]]) for k in keys]):
        cfg = dict(zip(keys, values))
        out.append(_judge(spec, cfg, cluster, dtype_bytes))
    return out


def _judge(spec: Any, cfg: dict[str, Any], cluster: Cluster, dtype_bytes: int) -> Candidate:
    tp, pp, mb, ep, cp = cfg["tp"], cfg["pp"], cfg["micro_batch"], cfg["ep"], cfg["cp"]
    config = {"dp": None, **cfg, "grad_accum": None}
    config = {k: config[k] for k in CONFIG_KEYS}
    if tp > cluster.slots_per_node:
        return Candidate(config, "pruned_batch", f"tp={tp} is larger than a node ({cluster.slots_per_node} workers)")
    raw = spec.model_dump(by_alias=True)
    raw["parallel"].update(cfg)
    try:
        trial = type(spec).from_dict(raw)
    except SpecError as exc:
        return Candidate(config, "pruned_batch", str(exc))
    e, gb = spec.elastic, spec.train.global_batch
    replica = tp * pp * ep * cp
    allowed = trial.allowed_dps()  # dp x ep data shards; whole HSDP shard groups when shard_group is set
    dp = policies.target_dp(cluster.worker_slots // replica, allowed)
    if dp is None:
        return Candidate(
            config,
            "pruned_batch",
            f"no DP degree in [{e.min_dp}, {e.max_dp}] reaches global_batch {gb} with micro_batch {mb} "
            f"on the cluster's {cluster.worker_slots} worker slots ({replica} per replica)",
        )
    config["dp"], config["grad_accum"] = dp, batch.grad_accum(gb, mb, dp, ep)
    if dp * ep * cp == 1 and cfg["zero"] > 0:
        return Candidate(config, "pruned_batch", f"dp=1: zero={cfg['zero']} has no DP group to shard over (= zero 0)")
    if cfg["shard_group"] is not None and cfg["shard_group"] >= dp:
        why = f"shard_group={cfg['shard_group']} >= dp={dp}: no replication across groups (= shard_group unset)"
        return Candidate(config, "pruned_batch", why)
    est = estimate_for_spec(trial, dp, dtype_bytes=dtype_bytes)
    budget = cluster.memory_per_worker_bytes
    if est.total > budget:
        return Candidate(
            config,
            "pruned_memory",
            f"predicted {est.total / GIB:.3f} GiB per worker > budget {budget / GIB:.3f} GiB",
            est.total,
        )
    return Candidate(config, "feasible", "", est.total)


def trial_spec_dict(spec: Any, config: dict[str, Any]) -> dict[str, Any]:
    """The job spec of one configuration (the user's spec, its ``parallel`` replaced)."""
    raw = spec.model_dump(by_alias=True)
    raw.setdefault("parallel", {}).update({k: config[k] for k in SPACE_KEYS if k in config})
    return raw
