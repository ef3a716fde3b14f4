"""specdec_core is Qt-free: importing all of it never loads PySide6 or the app; the app reaches
the models only through specdec_core (never torch or transformers itself)."""

from __future__ import annotations

import ast
import pkgutil
import subprocess
import sys
from pathlib import Path

import specdec_core


def test_core_never_imports_qt_or_the_app():
    modules = [f"specdec_core.{m.name}" for m in pkgutil.iter_modules(specdec_core.__path__)]
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
