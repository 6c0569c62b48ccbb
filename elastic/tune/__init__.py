"""Ray Tune sweeps over parallel configurations (``elastic sweep``; docs/sweep.md).

``space`` prunes (pure), ``search`` orders the trials, ``trial`` runs one configuration as
an elastic job inside its Tune placement group, ``report`` writes the results and ``api``
ties them together. The subcommand lives in ``jobs/sweep.py`` (elastic does not import jobs).
"""

from __future__ import annotations

__all__ = ["sweep", "run_sweep", "restore_trainable"]


def __getattr__(name: str):
    if name in __all__:
        from elastic.tune import api

        return getattr(api, name)
    raise AttributeError(name)
