"""Reading YAML input files with errors that name the field (exit code 2, no traceback)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from elastic.errors import SpecError


def read_yaml(path: str | Path, field: str) -> Any:
    """Parse a YAML file; a missing file or bad YAML is a ``SpecError`` on ``field``."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise SpecError(field, f"cannot read {path}: {exc.strerror}") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise SpecError(field, f"{path} is not valid YAML: {' '.join(str(exc).split())}") from None
