"""The bundle's entry script. PyInstaller runs it as `__main__`, outside any package, so it
imports the app by its installed name (app/main.py itself uses relative imports).

The library starts helpers as `sys.executable -m MODULE ...`: the GGUF conversion in a process
of its own, and pip to fetch a model's parts. In a bundle `sys.executable` is this program,
so those arguments run the module, as a Python interpreter would.
"""

import runpy
import sys

HELPER_MODULES = ("specdec_core.models.conversion_process", "pip")

if len(sys.argv) >= 3 and sys.argv[1] == "-m" and sys.argv[2] in HELPER_MODULES:
    module = sys.argv[2]
    sys.argv = [sys.argv[0], *sys.argv[3:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    sys.exit(0)

from specdec_app.main import main  # noqa: E402 (only when no helper module was asked for)

sys.exit(main())
