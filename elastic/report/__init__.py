"""Seeing a run: ``elastic report`` (figures and ``report.md``) and live Ray metrics (``docs/observability.md``)."""

from elastic.report.cli import write_report
from elastic.report.run_data import load_run, scale_factors

__all__ = ["load_run", "scale_factors", "write_report"]
