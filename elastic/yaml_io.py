"""Reading YAML input files with errors that name the field (exit code 2, no traceback).

Runs in the driver (``elastic`` CLI, the Python API), before anything starts. Two things
plain ``yaml.safe_load`` lets through are refused here: a key written twice in one mapping
(YAML keeps the last one silently, so a spec would run with a value its author did not
see), and a file that is not text. So is a document too large or deep to be a spec, which
would otherwise hang or crash the checks after it: an alias "bomb" (a few hundred bytes of
anchors that expand to 10^9 values), an alias that contains itself, or nesting deeper than
``MAX_DEPTH`` (Python's recursion limit is hit at about 1,000 levels).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import yaml

from elastic.errors import SpecError


class DuplicateKey(yaml.constructor.ConstructorError):
    """A mapping names the same key twice; ``path`` is the dotted key."""

    def __init__(self, path: str, line: int):
        self.path, self.line = path, line
        super().__init__(None, None, f"key {path!r} is given twice (line {line})")


MAX_VALUES = 100_000  # values of the document once every alias is expanded; a spec has < 1,000
MAX_DEPTH = 64  # nesting levels; a spec has 4


class TooComplex(yaml.YAMLError):
    """The document's shape is refused before it is built (see the module docstring)."""


def check_shape(root: yaml.Node) -> None:
    """Refuse a cycle through aliases, nesting deeper than ``MAX_DEPTH`` and more than
    ``MAX_VALUES`` values after alias expansion. Iterative, with each shared node's expanded
    size counted once, so the check itself costs the size of the text, not of the expansion."""
    size: dict[int, int] = {}
    depth: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        kids = _children(node)
        if children_done:
            on_path.discard(key)
            size[key] = 1 + sum(size[id(k)] for k in kids)
            depth[key] = 1 + max((depth[id(k)] for k in kids), default=0)
            if depth[key] > MAX_DEPTH:
                raise TooComplex(f"nested deeper than {MAX_DEPTH} levels (line {node.start_mark.line + 1})")
            if size[key] > MAX_VALUES:
                raise TooComplex(
                    f"expands to more than {MAX_VALUES:,} values (aliases of aliases, line {node.start_mark.line + 1})"
                )
            continue
        if key in size:
            continue
        on_path.add(key)
        stack.append((node, True))
        for kid in kids:
            if id(kid) in on_path:
                raise TooComplex(f"an alias contains itself (line {kid.start_mark.line + 1})")
            if id(kid) not in size:
                stack.append((kid, False))


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


class _StrictLoader(yaml.SafeLoader):
    """``SafeLoader`` that refuses a key written twice in one mapping."""

    _root: yaml.Node | None = None  # the document, kept to name a duplicate's dotted path

    def get_single_data(self) -> Any:
        try:
            self._root = self.get_single_node()
        except RecursionError:  # the composer recurses once per nesting level
            raise TooComplex(f"nested deeper than {MAX_DEPTH} levels") from None
        if self._root is not None:
            check_shape(self._root)
        return None if self._root is None else self.construct_document(self._root)

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base` overrides by design
                continue
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, (str, int, float, bool)) and key in seen:
                raise DuplicateKey(_dotted(self, node, key), key_node.start_mark.line + 1)
            if isinstance(key, (str, int, float, bool)):
                seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def _dotted(loader: _StrictLoader, node: yaml.MappingNode, key: Any) -> str:
    """The dotted path of ``key`` inside ``node`` (found from the document's root)."""
    path = _path_to(loader._root, node) if loader._root is not None else None
    return ".".join([*(path or []), str(key)])


def _path_to(current: yaml.Node, target: yaml.Node) -> list[str] | None:
    if current is target:
        return []
    if isinstance(current, yaml.MappingNode):
        for k, v in current.value:
            found = _path_to(v, target)
            if found is not None:
                return [str(k.value), *found]
    return None


def load_yaml(text: str) -> Any:
    """Parse one YAML document; a duplicated key raises ``DuplicateKey``."""
    loader = _StrictLoader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def read_yaml(path: str | Path, field: str) -> Any:
    """Parse a YAML file; a missing, binary or malformed file, or a key given twice, is a
    ``SpecError`` on ``field`` (a duplicated key names its own dotted path); so is anything
    but a regular file."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):  # a FIFO blocks the read for ever, a device never ends
            raise SpecError(field, f"{path} is not a regular file")
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise SpecError(field, f"{path} is not a text file (not UTF-8)") from None
    except OSError as exc:
        raise SpecError(field, f"cannot read {path}: {exc.strerror or type(exc).__name__}") from None
    try:
        return load_yaml(text)
    except DuplicateKey as exc:
        raise SpecError(exc.path, f"given twice in {path} (line {exc.line}); keep one") from None
    except yaml.YAMLError as exc:
        raise SpecError(field, f"{path} is not valid YAML: {' '.join(str(exc).split())}") from None
