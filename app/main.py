"""Entry points: `specdec-chat` (gui-script), `specdec chat`, and the test seam.

`--smoke-test PROMPT` runs the window once, offscreen, and exits (smoke.py).

`build_main_window(argv)` builds the window from the same arguments as
`specdec chat` and starts loading the models in the worker, without entering
the event loop, so tests drive the real window with pytest-qt.
"""

from __future__ import annotations

import argparse
import logging
import sys

from PySide6.QtCore import QEventLoop
from PySide6.QtWidgets import QApplication, QMainWindow

from specdec_core import prepare_process

from . import gc_guard, qt_platform
from .options import chat_parser

_app: QApplication | None = None  # kept alive for windows built outside of main()


def _application() -> QApplication:
    global _app
    existing = QApplication.instance()
    if isinstance(existing, QApplication):
        app = existing
    else:
        app = _app = QApplication(sys.argv[:1])
    app.setApplicationName("specdec")
    app.setOrganizationName("specdec")
    app.setApplicationDisplayName("specdec")
    app.setDesktopFileName("specdec")  # matches packaging/specdec.desktop (icon on Wayland)
    gc_guard.install(app)
    return app


def window_from_args(args: argparse.Namespace) -> QMainWindow:
    from .theme import app_icon
    from .window import ChatOptions, MainWindow

    app = _application()
    app.setWindowIcon(app_icon())
    options = ChatOptions(
        target=getattr(args, "server", None) or args.target or "",
        draft=args.draft or "",
        device=args.device or "",
        precision=args.precision or "",
        theme=args.theme or "",
        offload=getattr(args, "offload", False),
        trust_remote_code=getattr(args, "trust_remote_code", False),
    )
    return MainWindow(options)


def build_main_window(argv: list[str]) -> QMainWindow:
    """The window for `specdec chat ARGV`, loading its models, not shown, no event loop."""
    return window_from_args(chat_parser().parse_args(argv))


def run(args: argparse.Namespace) -> int:
    try:
        prepare_process()
    except ImportError as exc:  # a transformers the core cannot drive, in one line
        print(f"specdec-chat: error: {exc}", file=sys.stderr)
        return 1
    logging.basicConfig(level=logging.INFO, format="specdec: %(message)s")
    if getattr(args, "smoke_test", None) is not None:
        return _smoke_test(args)
    # Qt aborts the process when the xcb plugin cannot load: say what to install instead.
    hint = qt_platform.check_xcb()
    if hint is not None:
        print(hint, file=sys.stderr)
        return 2
    app = _application()
    window = window_from_args(args)
    window.show()
    code = int(app.exec())
    from .worker import EngineThread

    EngineThread.wait_all()  # a load cancelled at close may still be ending its chunk
    return code


def _smoke_test(args: argparse.Namespace) -> int:
    """`--smoke-test PROMPT` (smoke.py): the window answers once, offscreen, in a scratch data folder."""
    from .smoke import SmokeTest, scratch_data_dir, use_offscreen_platform
    from .worker import EngineThread

    use_offscreen_platform()
    with scratch_data_dir():
        _application()
        loop = QEventLoop()
        smoke = SmokeTest(window_from_args(args), args.smoke_test, loop.quit)
        smoke.window.show()
        if smoke.code is None:  # a failure while the window was built has ended the run already
            loop.exec()
        EngineThread.wait_all()
    return 1 if smoke.code is None else smoke.code


def main() -> int:
    """The `specdec-chat` gui-script."""
    return run(chat_parser().parse_args(sys.argv[1:]))


if __name__ == "__main__":
    sys.exit(main())
