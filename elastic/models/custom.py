"""``model.kind: custom``: a user's ``package.module:function`` that returns a ``ModelSpec``.

The factory is called with ``model.args`` as keyword arguments. The driver imports it when
the spec is validated (so a typo fails before anything starts, exit 2 naming
``model.factory``) and records the ``sys.path`` entry the module was found under; workers,
which may start elsewhere, put that entry first on their own ``sys.path`` before
importing it. On a real multi-machine cluster the user's code must be importable on every
node (a shared file system or Ray's ``runtime_env``), as with any Ray program.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from typing import Any, Protocol

from elastic.errors import SpecError
from elastic.models.spec import ModelSpec, register_model


class FactoryConfig(Protocol):
    """What this module reads and records of ``model`` (``elastic.models.config.CustomConfig``,
    which imports this module, lazily, to check a custom model: its shape is named here)."""

    factory: str
    args: dict[str, Any]
    _import_root: str | None  # where the driver found the module


_CACHE: dict[tuple[str, str], tuple[ModelSpec, str | None]] = {}  # -> (spec, import root)


def _import_factory(cfg: FactoryConfig):
    module_name, sep, fn_name = cfg.factory.partition(":")
    if not sep or not module_name or not fn_name:
        raise SpecError("model.factory", f"expected 'package.module:function', got {cfg.factory!r}")
    root = cfg._import_root
    if root and root not in sys.path:
        sys.path.insert(0, root)
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)  # `elastic run` from a project directory finds the project's modules
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # ImportError, or an error raised while importing the user's module
        raise SpecError("model.factory", f"cannot import {module_name!r}: {type(exc).__name__}: {exc}") from None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise SpecError("model.factory", f"{module_name!r} has no function {fn_name!r}")
    if cfg._import_root is None:
        cfg._import_root = _root_of(module, module_name)
    return fn


def _root_of(module: Any, module_name: str) -> str | None:
    """The sys.path entry ``module_name`` was imported from (its file minus the package path)."""
    path = getattr(module, "__file__", None)
    if not path:
        return None
    path = os.path.abspath(path)
    depth = module_name.count(".") + (1 if os.path.basename(path) == "__init__.py" else 0)
    root = os.path.dirname(path)
    for _ in range(depth):
        root = os.path.dirname(root)
    return root


def load_spec(cfg: FactoryConfig) -> ModelSpec:
    """Import and call the factory once per (factory, args) in this process."""
    key = (cfg.factory, json.dumps(cfg.args, sort_keys=True, default=str))
    spec, root = _CACHE.get(key) or (_call_factory(cfg), cfg._import_root)
    if cfg._import_root is None:
        cfg._import_root = root
    for name in ("vocab_size", "seq_len"):
        given = getattr(cfg, name)
        if given is not None and given != getattr(spec, name):
            raise SpecError(f"model.{name}", f"{given} differs from the factory's model ({getattr(spec, name)})")
    _CACHE[key] = (spec, cfg._import_root)
    return spec


def _call_factory(cfg: FactoryConfig) -> ModelSpec:
    fn = _import_factory(cfg)
    try:
        spec = fn(**cfg.args)
    except SpecError:
        raise
    except Exception as exc:
        raise SpecError("model.factory", f"{cfg.factory}(**model.args) raised {type(exc).__name__}: {exc}") from None
    if not isinstance(spec, ModelSpec):
        raise SpecError(
            "model.factory", f"{cfg.factory} returned {type(spec).__name__}, expected elastic.models.ModelSpec"
        )
    return spec


register_model("custom", load_spec)
