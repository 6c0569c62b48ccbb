"""Fixtures of the elastic tests: the fault-free reference trajectory, computed once."""

from __future__ import annotations

import pytest
from elastic_testlib import elastic_spec, step_metrics

from elastic import ElasticTrainer

_REFERENCE: dict[str, dict[int, tuple[float, float]]] = {}


def _reference(tmp_path_factory) -> dict[int, tuple[float, float]]:
    """The fault-free trajectory of ``elastic_spec()`` at dp 2, on whichever Ray is up."""
    if "ref" not in _REFERENCE:
        run_dir = str(tmp_path_factory.mktemp("reference"))
        result = ElasticTrainer(elastic_spec(min_dp=2, max_dp=2), run_dir=run_dir).fit()
        assert result.status == "succeeded"
        _REFERENCE["ref"] = step_metrics(run_dir)
    return _REFERENCE["ref"]


@pytest.fixture
def reference_losses(ray_local, tmp_path_factory):
    return _reference(tmp_path_factory)


@pytest.fixture
def reference_losses_cluster(tmp_path_factory):
    """For tests that own a Ray cluster: computed on it if no earlier test did."""
    return _reference(tmp_path_factory)
