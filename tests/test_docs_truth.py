"""The docs stay true (issue 45), read from the files, no cluster: every repository path the
README, ``docs/`` and ``benchmarks/README.md`` name exists and every relative link resolves;
every callback hook they name is one the controller calls, and a ``Callback`` subclass with a
method that looks like a hook but is none is refused; the CLI's own ``--help`` and the docs
list the same commands; ``benchmarks/results/`` holds one file per catalog entry."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

from elastic.control.callbacks import HOOKS, Callback

pytestmark = pytest.mark.timeout(60)

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
TOP = "elastic|storage|jobs|tests|benchmarks|examples|cluster_configs|docs"
# a file path (with an extension) or a folder (ending in /); metric names such as elastic/dp are neither
PATH = re.compile(rf"(?<![\w./<-])((?:{TOP})/[\w./-]*?(?:\.(?:py|md|sh|yaml|yml|json|toml|txt|log)|/))(?![\w<*])")
LINK = re.compile(r"\]\(([^)\s]+)\)")
HOOK_CALL = re.compile(r"`[^`\n]*?\b((?:on|before|after)_\w+)\(")


def _docs() -> list[pathlib.Path]:
    return [d for d in DOCS if d.exists()]


def test_every_path_and_link_the_docs_name_exists():
    missing = []
    for doc in _docs():
        text = doc.read_text()
        for m in PATH.finditer(text):
            if not (ROOT / m.group(1)).exists():
                missing.append(f"{doc.relative_to(ROOT)}: {m.group(1)}")
        for m in LINK.finditer(text):
            target = m.group(1).split("#")[0]
            if target and "://" not in target and not (doc.parent / target).exists():
                missing.append(f"{doc.relative_to(ROOT)}: link {target}")
    assert not missing, missing


def test_the_path_check_sees_a_missing_path():
    assert PATH.findall("see `elastic/worker.py` and `elastic/control/` but not `elastic/dp`") == [
        "elastic/worker.py",
        "elastic/control/",
    ]


def test_the_docs_name_only_hooks_the_controller_calls():
    """The controller's hooks, and Ray Train's ``UserCallback`` methods that a
    ``TorchTrainer`` run calls (``elastic/train/callbacks.py``)."""
    from elastic.train.callbacks import RAY_HOOKS

    named = {
        f"{doc.relative_to(ROOT)}: {m.group(1)}"
        for doc in _docs()
        for m in HOOK_CALL.finditer(doc.read_text())
        if m.group(1) not in HOOKS + RAY_HOOKS
    }
    assert not named, f"not hooks (the hooks are {HOOKS}, and Ray Train's {RAY_HOOKS}): {sorted(named)}"


def test_every_hook_is_called_by_the_runtime():
    """Each hook of ``Callback`` is read off a callback (``cb.<hook>``) somewhere in ``elastic/``."""
    called = set()
    for path in (ROOT / "elastic").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "cb":
                called.add(node.attr)
    assert set(HOOKS) <= called, f"hooks no code calls: {sorted(set(HOOKS) - called)}"
    defined = {n for n, v in vars(Callback).items() if callable(v) and not n.startswith("_")}
    assert defined == set(HOOKS)


@pytest.mark.parametrize("name", ["on_step", "on_reconfigure", "before_step", "after_report"])
def test_a_method_that_looks_like_a_hook_but_is_none_is_refused(name):
    with pytest.raises(TypeError) as err:
        type("Mine", (Callback,), {name: lambda self, *a: None})
    msg = str(err.value)
    assert "\n" not in msg and f"Mine.{name}" in msg and all(h in msg for h in HOOKS)


def test_real_hooks_and_helpers_are_accepted():
    class Fine(Callback):
        def after_step(self, step, group):
            self.seen = step

        def _on_helper(self):  # private: not a hook name
            pass

        def summary(self):
            pass

    Fine().after_step(3, None)


def _cli_commands() -> set[str]:
    from jobs.cli import build_parser

    parser = build_parser()
    help_text = parser.format_help()
    top = set(re.search(r"\{([\w,]+)\}", help_text).group(1).split(","))
    sub = next(a for a in parser._subparsers._group_actions)  # type: ignore[union-attr]
    out = set()
    for name in top:
        nested = [a for a in sub.choices[name]._actions if a.__class__.__name__ == "_SubParsersAction"]
        out |= {f"{name} {c}" for c in nested[0].choices} if nested else {name}
    return out


def _doc_commands(text: str, pattern: str) -> set[str]:
    found = set()
    for m in re.finditer(pattern, text, re.M):
        words = m.group(1).split()
        found.add(" ".join(words[:2]) if words[0] == "ckpt" else words[0])
    return found


def test_the_cli_help_and_the_docs_list_the_same_commands():
    commands = _cli_commands()
    assert {"run", "report", "ckpt export", "ckpt list", "ckpt verify"} <= commands
    cli_md = (ROOT / "docs" / "cli.md").read_text()
    in_cli_md = _doc_commands(cli_md, r"^## `elastic ((?:ckpt )?\w+)") | _doc_commands(
        cli_md, r"and `elastic ((?:ckpt )?\w+)"
    )
    assert in_cli_md == commands, f"docs/cli.md: {sorted(in_cli_md ^ commands)}"
    readme = (ROOT / "README.md").read_text()
    in_readme = _doc_commands(readme, r"^- `elastic ((?:ckpt )?\w+)")
    assert in_readme == commands, f"README.md's CLI list: {sorted(in_readme ^ commands)}"


def test_one_results_file_per_catalog_entry():
    from benchmarks.catalog import BENCHMARKS

    want = {b.results for b in BENCHMARKS if b.results}
    companions = {"gpu_check.log"}  # written beside gpu_check.json by the same run
    have = {p.name for p in (ROOT / "benchmarks" / "results").iterdir()}
    assert have - companions == want, f"extra: {sorted(have - companions - want)}, missing: {sorted(want - have)}"
