"""specdec_core is Qt-free: importing all of it never loads PySide6 or the app; the app reaches
the models only through specdec_core (never torch or transformers itself); no module imports
itself through others; importing the package leaves the process as it was."""

from __future__ import annotations

import ast
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

import specdec_core


def test_core_never_imports_qt_or_the_app():
    modules = [m.name for m in pkgutil.walk_packages(specdec_core.__path__, "specdec_core.")]
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('PySide6', 'qtawesome', 'specdec_app', 'app', 'qtpy')]\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ""


def test_the_app_never_imports_torch_or_transformers():
    app = Path(__file__).resolve().parents[1] / "app"
    found = []
    for file in sorted(app.glob("*.py")):
        for node in ast.walk(ast.parse(file.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            found += [f"{file.name}: {n}" for n in names if n.split(".")[0] in ("torch", "transformers")]
    assert found == []


def _circles(package: str) -> list[str]:
    """Each import circle once, as the chain of modules that closes it."""
    graph = grimp.build_graph(package, include_external_packages=False)
    found: dict[frozenset[str], str] = {}
    for module in sorted(graph.modules):
        for imported in sorted(graph.find_modules_directly_imported_by(module)):
            chain = graph.find_shortest_chain(importer=imported, imported=module)
            if chain and frozenset(chain) not in found:
                found[frozenset(chain)] = " -> ".join((module, *chain))
    return sorted(found.values())


@pytest.mark.parametrize("package", ["specdec_core", "specdec_app"])
def test_no_module_imports_itself_through_others(package):
    assert _circles(package) == []


def test_importing_the_package_changes_nothing_in_the_process():
    code = (
        "import os, sys; before = dict(os.environ); import specdec_core; "
        "print(dict(os.environ) == before, 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=_without_spin_settings())
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "False"]


def test_the_public_names_are_what_a_front_end_uses():
    assert len(specdec_core.__all__) <= 26
    for name in specdec_core.__all__:
        assert getattr(specdec_core, name) is not None


def _without_spin_settings() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
