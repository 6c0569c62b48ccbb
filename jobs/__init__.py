"""Job specs and thin entry points (``python -m jobs.train``)."""

from jobs.spec import JobSpec

__all__ = ["JobSpec"]
