"""Live tensor bytes: a CPU stand-in for ``torch.cuda.max_memory_allocated``.

``LiveTensorBytes`` is a ``TorchDispatchMode`` that sees the storage of every tensor an op
returns (DTensors and other wrapper subclasses flattened to their local tensors), wraps
``UntypedStorage.resize_`` (FSDP2 frees and re-allocates its unsharded parameters that way)
and keeps a weak reference per storage, so a storage's bytes leave the count when it is
freed. The peak is sampled after every op and every resize. It cannot see memory that a
kernel allocates and frees before returning, buffers that C++ owns and never returns to
Python (gloo's staging buffers), or allocator overheads. Used by the sweep's memory probe
(``TrainEngine`` with ``memory_probe_step``) and by ``elastic/testing/layout_memory.py``.
Dispatch modes are thread-local: only the thread that entered the mode is seen.
"""

from __future__ import annotations

import functools
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass


def _storages(t: torch.Tensor) -> list[torch.UntypedStorage]:
    """The real storages behind ``t`` (wrapper subclasses such as DTensor flattened)."""
    if is_traceable_wrapper_subclass(t):
        attrs, _ = t.__tensor_flatten__()
        out: list[torch.UntypedStorage] = []
        for attr in attrs:
            inner = getattr(t, attr)
            if isinstance(inner, torch.Tensor):
                out.extend(_storages(inner))
        return out
    if t.device.type == "meta":
        return []
    try:
        return [t.untyped_storage()]
    except (RuntimeError, NotImplementedError):
        return []


def tensors_in(obj) -> list[torch.Tensor]:
    """The tensors in a nest of dicts, lists and tuples (no closure: no reference cycle
    that would keep the tensors alive past their last use)."""
    out: list[torch.Tensor] = []
    stack = [obj]
    while stack:
        o = stack.pop()
        if isinstance(o, torch.Tensor):
            out.append(o)
        elif isinstance(o, dict):
            stack.extend(o.values())
        elif isinstance(o, (list, tuple)):
            stack.extend(o)
    return out


def tensor_bytes(tensors, device: torch.device) -> int:
    """Bytes of the distinct storages behind ``tensors`` on ``device``."""
    seen: dict[int, int] = {}
    for t in tensors:
        for st in _storages(t):
            if st.device.type == device.type:
                seen[st.data_ptr() or id(st)] = st.nbytes()
    return sum(seen.values())


class LiveTensorBytes(TorchDispatchMode):
    """Peak bytes of live tensor storages on one device type; see the module docstring."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device_type = device.type
        self._live: dict[int, list] = {}  # id(storage) -> [weakref, bytes counted]
        self.current = 0
        self.peak = 0
        self._orig_resize = None

    def register(self, tensors) -> None:
        for t in tensors:
            for st in _storages(t):
                self._track(st)

    def _track(self, st: torch.UntypedStorage) -> None:
        if st.device.type != self.device_type:
            return
        nbytes = st.nbytes()
        entry = self._live.get(id(st))
        if entry is None:
            key = id(st)
            self._live[key] = [weakref.ref(st, functools.partial(self._gone, key)), nbytes]
            self.current += nbytes
        elif entry[1] != nbytes:
            self.current += nbytes - entry[1]
            entry[1] = nbytes
        if self.current > self.peak:
            self.peak = self.current

    def _gone(self, key: int, _ref) -> None:
        entry = self._live.pop(key, None)
        if entry is not None:
            self.current -= entry[1]

    def __enter__(self):
        tracker, orig = self, torch.UntypedStorage.resize_
        self._orig_resize = orig

        def resize_(st, size):
            out = orig(st, size)
            tracker._track(st)
            return out

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._orig_resize
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tensors_in(out):
            for st in _storages(t):
                self._track(st)
        return out
