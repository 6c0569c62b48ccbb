"""Elastic, topology-aware training on Ray."""

from __future__ import annotations

__all__ = ["ElasticTrainer", "RunResult"]


def __getattr__(name: str):
    # Lazy: `import elastic` stays cheap for the CLI's input checks.
    if name in __all__:
        from elastic import trainer

        return getattr(trainer, name)
    raise AttributeError(name)
