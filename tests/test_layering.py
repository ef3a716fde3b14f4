"""specdec_core is Qt-free: importing all of it never loads PySide6 or the app."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import specdec_core


def test_core_never_imports_qt_or_the_app():
    modules = [f"specdec_core.{m.name}" for m in pkgutil.iter_modules(specdec_core.__path__)]
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('PySide6', 'qtawesome', 'app', 'qtpy')]\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ""
