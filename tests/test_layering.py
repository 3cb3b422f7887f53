"""Evaluation and training are layers side by side: neither imports the other, directly or through
another envace module (what both need lives below them: envace.metrics, envace.manifest). Read
from the source's import statements, function-level ones included, so a lazy import counts too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import envace

ROOT = Path(envace.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in ROOT.rglob("*.py")}


def with_packages(name: str) -> set[str]:
    """Importing a.b.c runs a/__init__ and a/b/__init__ first."""
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts) + 1)} & MODULES.keys()


def imported(name: str) -> set[str]:
    """The envace modules one module's import statements load."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {m for alias in node.names for m in with_packages(alias.name)}
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            source = ".".join(p for p in (base, node.module) if p)
            found |= with_packages(source) | {m for alias in node.names for m in with_packages(f"{source}.{alias.name}")}
    return found


def reachable(start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for m in imported(todo.pop()) - seen:
            seen.add(m)
            todo.append(m)
    return seen


def test_the_import_reader_sees_a_lazy_import():
    # envace.evaluation.runner imports the data manifest inside a function (check_leakage).
    assert "envace.manifest" in imported("envace.evaluation.runner")


@pytest.mark.parametrize("layer,other", [("envace.evaluation", "envace.training"), ("envace.training", "envace.evaluation")])
def test_evaluation_and_training_do_not_import_each_other(layer, other):
    inside = [m for m in MODULES if m == layer or m.startswith(layer + ".")]
    assert inside
    crossing = {m: sorted(r for r in reachable(m) if r == other or r.startswith(other + ".")) for m in inside}
    assert {m: r for m, r in crossing.items() if r} == {}
