"""Plain-data encoding of non-tensor checkpoint state (JSON, never pickle).

Loading must never unpickle objects from storage, so step counters, data cursors, LR-schedule
state and RNG states are stored as JSON. JSON lacks tuples, non-string keys, non-finite floats
and tensors, so those are tagged::

    (1, 2)               -> {"__tuple__": [1, 2]}
    {0: "a"}             -> {"__dict__": [[0, "a"]]}
    float("nan")         -> {"__float__": "nan"}
    torch.tensor([1, 2]) -> {"__tensor__": {"dtype": "int64", "shape": [2], "data": "<base64>"}}

Anything else (arbitrary classes) is rejected at save time with the offending path.
"""

from __future__ import annotations

import base64
import json
import math
from typing import Any

import torch

_TAGS = ("__tuple__", "__dict__", "__float__", "__tensor__")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def encode(obj: Any, path: str = "") -> Any:
    """``obj`` as JSON-serialisable data; raises TypeError naming ``path`` for unknown types."""
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else {"__float__": repr(obj)}
    if isinstance(obj, torch.Tensor):
        return {"__tensor__": _encode_tensor(obj)}
    if isinstance(obj, tuple):
        return {"__tuple__": [encode(v, f"{path}[{i}]") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [encode(v, f"{path}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj) and not (len(obj) == 1 and next(iter(obj)) in _TAGS):
            return {k: encode(v, f"{path}.{k}") for k, v in obj.items()}
        return {"__dict__": [[encode(k, path), encode(v, f"{path}.{k}")] for k, v in obj.items()]}
    raise TypeError(f"{path or 'object'}: {type(obj).__name__} is not plain data (use int/float/str/list/dict/tensor)")


def decode(data: Any) -> Any:
    """Inverse of :func:`encode`."""
    if isinstance(data, list):
        return [decode(v) for v in data]
    if not isinstance(data, dict):
        return data
    if len(data) == 1:
        tag, value = next(iter(data.items()))
        if tag == "__tuple__":
            return tuple(decode(v) for v in value)
        if tag == "__dict__":
            return {_hashable(decode(k)): decode(v) for k, v in value}
        if tag == "__float__":
            return float(value)
        if tag == "__tensor__":
            return _decode_tensor(value)
    return {k: decode(v) for k, v in data.items()}


def dumps(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, allow_nan=False, separators=(",", ":"))


def _encode_tensor(t: torch.Tensor) -> dict[str, Any]:
    t = t.detach().to("cpu").contiguous()
    raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return {"dtype": dtype_name(t.dtype), "shape": list(t.shape), "data": base64.b64encode(raw).decode("ascii")}


def _decode_tensor(value: dict[str, Any]) -> torch.Tensor:
    dtype = dtype_from_name(value["dtype"])
    shape = [int(s) for s in value["shape"]]
    raw = base64.b64decode(value["data"])
    if not raw:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape).clone()


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, (list, tuple)) else key
