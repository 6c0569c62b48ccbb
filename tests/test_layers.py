"""The shape of the runtime, read from the source (``ast``), nothing imported:

* the packages depend one way: ``jobs -> elastic -> storage``, and production code never
  imports the test package;
* worker-side files (``elastic/worker/``) import nothing from the control package: each
  file sits on one side of the actor boundary;
* no import circle among the modules of ``elastic/``, ``storage/`` and ``jobs/``, nor among
  ``elastic/``'s sub-packages (``models`` and ``parallel`` share their types through
  ``protocols``, below both);
* one concept per file: a file holds one class or one algorithm, whatever its length up to
  ``MAX_LINES``, and no class is cut across files (a base class in another module of the
  same package that exists only to be the base of one class is a piece of that class).

What counts as an import: every ``import`` statement in the module, a lazy one inside a
function included (a lazy import only defers a circle to the call that closes it; it is
still a dependency of the module), and a type-only one under ``if TYPE_CHECKING:`` too (it
never runs, but a reader following the types goes round the same circle: a type two
modules share lives below both). An import names a module: ``from a.b import c`` depends
on ``a.b.c`` when that is a module, else on ``a.b``; the package ``__init__`` files that
Python runs on the way count for an importer outside that package (for one inside it, the
package is being initialised already; counting them there would make every package a
circle with its own modules).
"""

from __future__ import annotations

import ast
import pathlib

import pytest

pytestmark = pytest.mark.timeout(30)

ROOT = pathlib.Path(__file__).resolve().parents[1]
LAYER = {"storage": 0, "elastic": 1, "jobs": 2}
RUNTIME = tuple(sorted(LAYER))
MAX_LINES = 800  # one class or one algorithm may reach this (torchtitan's trainer, torchft's manager)

# Runtime files over MAX_LINES (none today). The list only shrinks: a file back under the
# limit must leave it (the test says so), and no file joins.
OVER_THE_LIMIT: set[str] = set()


def _modules(package: str) -> list[pathlib.Path]:
    return sorted((ROOT / package).rglob("*.py"))


def _module_name(path: pathlib.Path, root: pathlib.Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_nodes(node: ast.AST):
    """Every import statement under ``node``: lazy ones and those under ``if TYPE_CHECKING:`` included."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child
        else:
            yield from _import_nodes(child)


def _imports(path: pathlib.Path, root: pathlib.Path = ROOT) -> list[tuple[str, list[str]]]:
    """(module, names imported from it) per import; relative imports resolved to absolute."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = _module_name(path, root).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    out = []
    for node in _import_nodes(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names]
        else:
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            out.append((module, [a.name for a in node.names]))
    return out


def _imported_names(path: pathlib.Path) -> list[str]:
    return [module for module, _ in _imports(path)]


def _import_graph(root: pathlib.Path, packages: tuple[str, ...]) -> dict[str, set[str]]:
    """Module -> the modules of ``packages`` it imports (see the module docstring)."""
    files = {_module_name(p, root): p for package in packages for p in sorted((root / package).rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        deps = set()
        for module, names in _imports(path, root):
            for sub in names:
                if f"{module}.{sub}" in files:
                    deps.add(f"{module}.{sub}")
                elif module in files:
                    deps.add(module)
            if not names and module in files:
                deps.add(module)
        graph[name] = (deps | _inits_on_the_way(name, deps, files)) - {name}
    return graph


def _inits_on_the_way(importer: str, deps: set[str], files: dict[str, pathlib.Path]) -> set[str]:
    """The packages whose ``__init__`` Python runs to import ``deps`` and that ``importer``
    is not inside: ``elastic.control.stop`` importing ``elastic.control.controller.states``
    runs ``elastic/control/controller/__init__.py`` first, and a circle through it fails at
    import time as any other does (one did: ``stop`` -> ``controller/__init__`` ->
    ``controller.controller`` -> ``stop``). A module inside the package finds it being
    initialised already, so its own package's ``__init__`` is no dependency of it."""
    out = set()
    for dep in deps:
        parts = dep.split(".")
        for i in range(1, len(parts)):
            package = ".".join(parts[:i])
            if package in files and files[package].name == "__init__.py" and not importer.startswith(package + "."):
                out.add(package)
    return out


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


@pytest.mark.parametrize("package", sorted(LAYER))
def test_no_module_imports_upward(package):
    upward = []
    for path in _modules(package):
        for name in _imported_names(path):
            top = name.split(".")[0]
            if top in LAYER and LAYER[top] > LAYER[package]:
                upward.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not upward, upward


def test_production_code_does_not_import_the_test_package():
    """``elastic.testing`` (measurement helpers, the rank harness) reaches the workers only
    through the ``StepHook`` seam; the ``jobs`` layer may use it (the demo)."""
    bad = []
    for package in ("storage", "elastic"):
        for path in _modules(package):
            if "testing" in path.relative_to(ROOT).parts:
                continue
            for name in _imported_names(path):
                if name == "tests" or name.startswith(("tests.", "elastic.testing")):
                    bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not bad, bad


def test_worker_side_imports_nothing_from_the_control_package():
    """A worker's files run in the rank's process: the driver's control loop stays out."""
    bad = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in sorted((ROOT / "elastic" / "worker").rglob("*.py"))
        for name in _imported_names(path)
        if name == "elastic.control" or name.startswith("elastic.control.")
    ]
    assert not bad, bad


def test_no_import_circle_in_the_runtime():
    circles = _circles(_import_graph(ROOT, RUNTIME))
    assert not circles, "import circles: " + "; ".join(" <-> ".join(c) for c in circles)


def _package_graph(graph: dict[str, set[str]], root: pathlib.Path, top: str = "elastic") -> dict[str, set[str]]:
    """Sub-package of ``top`` -> the sub-packages its modules import (a directory with an
    ``__init__.py``; the modules directly in ``top`` are none)."""
    packages = {p.parent.name for p in (root / top).glob("*/__init__.py")}

    def package_of(module: str) -> str | None:
        parts = module.split(".")
        return f"{top}.{parts[1]}" if len(parts) > 1 and parts[0] == top and parts[1] in packages else None

    out: dict[str, set[str]] = {f"{top}.{p}": set() for p in packages}
    for module, deps in graph.items():
        mine = package_of(module)
        if mine is not None:
            out[mine] |= {d for d in map(package_of, deps) if d is not None and d != mine}
    return out


def test_no_import_circle_among_the_sub_packages():
    circles = _circles(_package_graph(_import_graph(ROOT, RUNTIME), ROOT))
    assert not circles, "sub-package circles: " + "; ".join(" <-> ".join(c) for c in circles)


def test_no_runtime_file_over_max_lines():
    lengths = {
        str(path.relative_to(ROOT)): len(path.read_text().splitlines())
        for package in RUNTIME
        for path in _modules(package)
    }
    over = sorted(f"{p} ({n} lines)" for p, n in lengths.items() if n > MAX_LINES and p not in OVER_THE_LIMIT)
    assert not over, f"over {MAX_LINES} lines (one class or one algorithm per file): {over}"
    done = sorted(p for p in OVER_THE_LIMIT if lengths.get(p, 0) <= MAX_LINES)
    assert not done, f"no longer over {MAX_LINES} lines (or gone): remove from OVER_THE_LIMIT: {done}"


def _split_classes(root: pathlib.Path, packages: tuple[str, ...]) -> list[str]:
    """ "Sub <- Base" for each base class that is defined in another module of Sub's package
    and has Sub as its only subclass (protocols, ABCs and exceptions aside): one class cut
    into files."""
    files = {_module_name(p, root): p for package in packages for p in sorted((root / package).rglob("*.py"))}
    bases: dict[tuple[str, str], list[str]] = {}
    subs: dict[tuple[str, str], list[tuple[str, str]]] = {}
    for module, path in files.items():
        origin = {name: source for source, names in _imports(path, root) for name in names}
        tree = ast.parse(path.read_text(), filename=str(path))
        local = {node.name for node in tree.body if isinstance(node, ast.ClassDef)}
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                bases[(module, node.name)] = [ast.unparse(b) for b in node.bases]
                for b in node.bases:
                    if isinstance(b, ast.Name) and (b.id in origin or b.id in local):
                        where = module if b.id in local else origin[b.id]
                        subs.setdefault((where, b.id), []).append((module, node.name))
    split = []
    for (module, name), children in subs.items():
        if (module, name) not in bases or len(children) != 1 or children[0][0] == module:
            continue
        if children[0][0].rsplit(".", 1)[0] != module.rsplit(".", 1)[0]:
            continue
        kinds = bases[(module, name)]
        if any(b in ("Protocol", "ABC", "Exception") or b.endswith(("Error", "Protocol")) for b in kinds):
            continue
        split.append(f"{children[0][0]}.{children[0][1]} <- {module}.{name}")
    return sorted(split)


def test_no_class_is_cut_across_files():
    """None today (issue 45 re-cut the last ones by concept), and none may come back."""
    split = _split_classes(ROOT, RUNTIME)
    assert not split, f"one class cut across files (merge the base into its only subclass's file): {split}"


def test_the_checks_see_what_they_forbid(tmp_path):
    """The checkers themselves, on planted code: an upward lazy import, a worker importing
    the control package, a circle closed by a type-only import or by a lazy one, a circle
    of sub-packages."""
    pkg = tmp_path / "elastic"
    (pkg / "worker").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "worker" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from jobs.spec import JobSpec\n    from elastic import b\n")
    (pkg / "b.py").write_text("import elastic.c\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import elastic.b\n")
    (pkg / "d.py").write_text("from . import a\n")
    (pkg / "worker" / "w.py").write_text("from ..control.stop import save\nfrom elastic.control import health\n")
    assert "jobs.spec" in [m for m, _ in _imports(pkg / "a.py", tmp_path)]
    assert [m for m, _ in _imports(pkg / "worker" / "w.py", tmp_path)] == ["elastic.control.stop", "elastic.control"]
    graph = _import_graph(tmp_path, ("elastic",))
    assert graph["elastic.c"] == {"elastic.b"} and _circles(graph) == [["elastic.b", "elastic.c"]]
    (pkg / "c.py").write_text("def g():\n    from elastic.d import a\n")
    assert _circles(_import_graph(tmp_path, ("elastic",))) == [["elastic.a", "elastic.b", "elastic.c", "elastic.d"]]
    (pkg / "c.py").write_text("")
    assert _circles(_package_graph(_import_graph(tmp_path, ("elastic",)), tmp_path)) == []
    (pkg / "control").mkdir()
    (pkg / "control" / "__init__.py").write_text("")
    (pkg / "control" / "stop.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from elastic.worker import w\n"
    )
    packages = _package_graph(_import_graph(tmp_path, ("elastic",)), tmp_path)
    assert packages == {"elastic.worker": {"elastic.control"}, "elastic.control": {"elastic.worker"}}
    assert _circles(packages) == [["elastic.control", "elastic.worker"]]


def test_the_split_class_check_sees_a_cut_class(tmp_path):
    """Planted: a class over a base in a sibling file used by it alone is cut; a base with two
    subclasses, one in another package, or a protocol is not."""
    pkg = tmp_path / "elastic"
    (pkg / "x").mkdir(parents=True)
    for init in (pkg / "__init__.py", pkg / "x" / "__init__.py"):
        init.write_text("")
    (pkg / "x" / "fields.py").write_text("class Fields:\n    pass\nclass Shared:\n    pass\n")
    (pkg / "x" / "port.py").write_text("from typing import Protocol\nclass Port(Protocol):\n    pass\n")
    (pkg / "x" / "big.py").write_text(
        "from elastic.x.fields import Fields, Shared\nfrom elastic.x.port import Port\n"
        "class Big(Fields, Port):\n    pass\nclass One(Shared):\n    pass\nclass Two(Shared):\n    pass\n"
    )
    (pkg / "other.py").write_text("from elastic.x.fields import Fields\n")
    assert _split_classes(tmp_path, ("elastic",)) == ["elastic.x.big.Big <- elastic.x.fields.Fields"]
