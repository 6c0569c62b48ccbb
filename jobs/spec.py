"""``jobs.JobSpec``, the public name of the job spec (DESIGN §4).

The model itself lives in ``elastic/spec.py`` so that the runtime can type its spec without
importing upwards; this module is where users and entry points take it from.
"""

from elastic.spec import JobSpec

__all__ = ["JobSpec"]
