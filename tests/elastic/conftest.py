"""Fixtures of the elastic tests: the fault-free reference trajectory, computed once."""

from __future__ import annotations

import pytest
from elastic_testlib import elastic_spec, step_losses

from elastic import ElasticTrainer

_REFERENCE: dict[str, dict[int, float]] = {}


@pytest.fixture
def reference_losses(ray_local, tmp_path_factory):
    """The fault-free trajectory of ``elastic_spec()`` (computed once, at dp 2)."""
    if "ref" not in _REFERENCE:
        spec = elastic_spec(min_dp=2, max_dp=2)
        run_dir = str(tmp_path_factory.mktemp("reference"))
        result = ElasticTrainer(spec, run_dir=run_dir).fit()
        assert result.status == "succeeded"
        _REFERENCE["ref"] = step_losses(run_dir)
    return _REFERENCE["ref"]


@pytest.fixture
def reference_losses_cluster(tmp_path_factory):
    """The same fault-free trajectory, for tests that own a Ray cluster (computed in-cluster if needed)."""
    if "ref" not in _REFERENCE:
        spec = elastic_spec(min_dp=2, max_dp=2)
        run_dir = str(tmp_path_factory.mktemp("reference"))
        result = ElasticTrainer(spec, run_dir=run_dir).fit()
        assert result.status == "succeeded"
        _REFERENCE["ref"] = step_losses(run_dir)
    return _REFERENCE["ref"]
