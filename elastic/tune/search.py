"""The order in which a sweep measures configurations: a Tune ``Searcher``.

Without ``--exhaustive`` the sweep does not launch every feasible configuration. It
groups them by layout and sharding, ``(dp, tp, pp, ep, cp, zero, shard_group)``, and measures in two stages:

1. **screen**: one trial per group, at the configuration that is fastest by the usual
   rule when memory allows it: no activation recomputation, the largest micro-batch
   (fewer, larger matmuls and fewer gradient-accumulation rounds);
2. **refine**: the other configurations (micro-batch, recomputation) of the best
   ``refine_groups`` groups of stage 1.

Early stopping (ASHA, ``elastic/tune/api.py``) cuts the slow trials of both stages short.
``max_trials`` caps the trials launched. The exhaustive grid does not use this class.
"""

from __future__ import annotations

import json
import math
from typing import Any

from ray.tune.search import Searcher

from elastic.tune.space import config_key


def group_of(config: dict[str, Any]) -> tuple[Any, ...]:
    return (
        config["dp"],
        config["tp"],
        config["pp"],
        config.get("ep", 1),
        config.get("cp", 1),
        config["zero"],
        config.get("shard_group"),
    )


def prior_order(configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Fastest first by the rule of thumb: no recompute, then the largest micro-batch."""
    return sorted(configs, key=lambda c: (c["activation_checkpointing"], -c["micro_batch"]))


def default_refine_groups(n_groups: int) -> int:
    return max(1, math.ceil(n_groups / 6))


class StagedSearch(Searcher):
    def __init__(
        self,
        configs: list[dict[str, Any]],
        max_trials: int | None = None,
        refine_groups: int | None = None,
        metric: str | None = None,
        mode: str | None = None,
    ):
        super().__init__(metric=metric, mode=mode)
        self.groups: dict[tuple, list[dict[str, Any]]] = {}
        for c in configs:
            self.groups.setdefault(group_of(c), []).append(c)
        for g in self.groups:
            self.groups[g] = prior_order(self.groups[g])
        self.refine_groups = refine_groups or default_refine_groups(len(self.groups))
        self.max_trials = max_trials
        self.queue: list[dict[str, Any]] = [cs[0] for cs in self.groups.values()]
        self.stage = 1
        self.launched = 0
        self.live: set[str] = set()
        self.trial_config: dict[str, dict[str, Any]] = {}
        self.score: dict[str, float] = {}  # trial id -> its last reported metric

    def set_search_properties(self, metric: str | None, mode: str | None, config: dict, **spec: Any) -> bool:
        self._metric = metric or self._metric
        self._mode = mode or self._mode
        return True

    # Ray annotates suggest as Optional[Dict], but its contract (the docstring; SearchGenerator
    # and ConcurrencyLimiter compare the result with it) includes the string Searcher.FINISHED.
    def suggest(self, trial_id: str) -> dict | str | None:  # type: ignore[override]
        if self.max_trials is not None and self.launched >= self.max_trials:
            return Searcher.FINISHED
        if not self.queue and self.stage == 1:
            if self.live:
                return None  # wait for the screening results
            self._start_refine()
        if not self.queue:
            return Searcher.FINISHED
        config = self.queue.pop(0)
        self.launched += 1
        self.live.add(trial_id)
        self.trial_config[trial_id] = config
        return {"cfg": config}

    def _start_refine(self) -> None:
        self.stage = 2
        sign = -1.0 if self.mode == "min" else 1.0
        by_group: dict[tuple, float] = {}
        for tid, cfg in self.trial_config.items():
            if tid in self.score:
                by_group[group_of(cfg)] = max(by_group.get(group_of(cfg), -math.inf), sign * self.score[tid])
        best = sorted(by_group, key=lambda g: -by_group[g])[: self.refine_groups]
        tried = {config_key(c) for c in self.trial_config.values()}
        self.queue = [c for g in best for c in self.groups[g] if config_key(c) not in tried]

    def on_trial_result(self, trial_id: str, result: dict) -> None:
        if self.metric in result and result.get("status") in ("running", "ok"):
            self.score[trial_id] = float(result[self.metric])

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
        self.live.discard(trial_id)
        if result and not error:
            if result.get("status") in ("running", "ok") and self.metric in result:
                self.score[trial_id] = float(result[self.metric])
            else:
                self.score.pop(trial_id, None)  # a failed trial ranks no group

    # Tune checkpoints the searcher with the experiment, so ``Tuner.restore`` resumes the plan.
    # As JSON, not a pickle: a sweep's output folder may be shared, and loading a pickle
    # from it would run whatever code someone put there.
    _STATE = ("refine_groups", "max_trials", "queue", "stage", "launched", "trial_config", "score")

    def save(self, checkpoint_path: str) -> None:
        state = {k: getattr(self, k) for k in self._STATE}
        state["groups"] = [[list(g), configs] for g, configs in self.groups.items()]
        state["live"] = sorted(self.live)
        with open(checkpoint_path, "w") as f:
            json.dump(state, f)

    def restore(self, checkpoint_path: str) -> None:
        with open(checkpoint_path) as f:
            state = json.load(f)
        self.groups = {tuple(g): configs for g, configs in state.pop("groups")}
        self.live = set(state.pop("live"))
        for k in self._STATE:
            setattr(self, k, state[k])
