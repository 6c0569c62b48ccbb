"""Limits a job spec must respect beyond each field's own range (driver side, before anything
starts; ``JobSpec`` calls them).

- Every number is finite. YAML reads ``.inf`` and ``.nan`` as floats, and a range check
  lets ``inf`` through (``inf > 0``); a timeout of ``inf`` then shows up much later as a
  misleading failure, and an ``inf`` learning rate as a NaN loss.
- Sizes the driver can hold: the synthetic corpus is made in the driver's memory, so an
  absurd ``model.seq_len`` or ``data.num_samples`` is refused here rather than found by the
  kernel's OOM killer.
"""

from __future__ import annotations

import math
import os
from typing import Any

from pydantic import BaseModel

from elastic.errors import SpecError

MAX_SEQ_LEN = 1 << 24  # tokens per sample: far above any context trained today
TOKEN_BYTES = 4  # the synthetic corpus stores int32 ids
MEMORY_SHARE = 0.5  # of the driver machine's memory that the synthetic corpus may take


def first_non_finite(value: Any, path: str = "") -> tuple[str, float] | None:
    """The dotted path and value of the first NaN or infinite float in ``value`` (a raw spec
    mapping or a validated model; model fields are named by their alias), or None."""
    if isinstance(value, float):
        return None if math.isfinite(value) else (path, value)
    items: list[tuple[object, Any]]
    if isinstance(value, BaseModel):
        items = [(f.alias or name, getattr(value, name)) for name, f in type(value).model_fields.items()]
    elif isinstance(value, dict):
        items = list(value.items())
    elif isinstance(value, (list, tuple)):
        items = list(enumerate(value))
    else:
        return None
    for key, child in items:
        found = first_non_finite(child, f"{path}.{key}" if path else str(key))
        if found is not None:
            return found
    return None


def check_finite(value: Any) -> None:
    found = first_non_finite(value)
    if found is not None:
        raise SpecError(found[0], f"must be a finite number, got {found[1]}")


def check_no_bool_numbers(raw: Any, model: Any, path: str = "") -> None:
    """A YAML ``true``/``false`` where the field is a number: pydantic's lax mode reads
    ``train.steps: true`` as 1 and runs one step; refused, naming the field."""
    if not (isinstance(raw, dict) and isinstance(model, BaseModel)):
        return
    by_alias = {(f.alias or name): name for name, f in type(model).model_fields.items()}
    for key, value in raw.items():
        name = by_alias.get(str(key), str(key))
        if not hasattr(model, name):
            continue
        got = getattr(model, name)
        where = f"{path}.{key}" if path else str(key)
        if isinstance(value, bool) and isinstance(got, (int, float)) and not isinstance(got, bool):
            raise SpecError(where, f"must be a number, got {str(value).lower()}")
        check_no_bool_numbers(value, got, where)


def check_sizes(spec: Any) -> None:
    """``model.seq_len`` within ``MAX_SEQ_LEN``; a synthetic corpus that fits in the driver."""
    seq_len = spec.model.seq_len
    if seq_len is not None and seq_len > MAX_SEQ_LEN:
        raise SpecError("model.seq_len", f"{seq_len} is larger than the supported {MAX_SEQ_LEN} tokens per sample")
    if spec.data.source != "synthetic" or seq_len is None:
        return
    budget = MEMORY_SHARE * physical_memory_bytes()
    row = (seq_len + 1) * TOKEN_BYTES
    need = spec.data.num_samples * row
    if need <= budget:
        return
    field = "model.seq_len" if row > budget else "data.num_samples"
    raise SpecError(
        field,
        f"the synthetic corpus would take {need / 2**30:.1f} GiB of driver memory (data.num_samples "
        f"{spec.data.num_samples} x (model.seq_len + 1) x {TOKEN_BYTES} bytes), more than "
        f"{MEMORY_SHARE:.0%} of this machine's {physical_memory_bytes() / 2**30:.1f} GiB",
    )


def physical_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not a POSIX sysconf: assume a small machine
        return 8 << 30
