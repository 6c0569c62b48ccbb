"""Elastic, topology-aware training on Ray."""

from __future__ import annotations

__all__ = ["ElasticTrainer", "RunResult", "sweep"]


def __getattr__(name: str):
    # Lazy: `import elastic` stays cheap for the CLI's input checks.
    if name == "sweep":  # elastic.sweep(spec, space=...) -> ray.tune.ResultGrid (docs/sweep.md)
        from elastic.tune.api import sweep

        return sweep
    if name in __all__:
        from elastic import api

        return getattr(api, name)
    raise AttributeError(name)
