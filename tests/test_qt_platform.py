"""Starting on X11 without the xcb plugin's libraries is one line naming the packages, exit 2;
the offscreen path (tests, CI) and Wayland sessions are never checked."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from specdec_app import main, qt_platform
from specdec_app.options import chat_parser

ON_LINUX = sys.platform.startswith("linux")


def _missing(*sonames: str):
    return lambda soname: soname not in sonames


def test_missing_xcb_libraries_are_one_line_naming_debian_and_fedora_packages(monkeypatch, capsys):
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setenv("QT_QPA_PLATFORM", "xcb")
    monkeypatch.setenv("DISPLAY", ":0")
    monkeypatch.setattr(qt_platform, "_loadable", _missing("libxcb-icccm.so.4", "libxcb-keysyms.so.1"))

    def never(*_args):
        raise AssertionError("Qt must not start when its platform plugin cannot load")

    monkeypatch.setattr(main, "_application", never)
    monkeypatch.setattr(main, "window_from_args", never)
    assert main.run(chat_parser().parse_args([])) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "libxcb-icccm.so.4, libxcb-keysyms.so.1" in err
    assert "sudo apt install libxcb-icccm4 libxcb-keysyms1" in err
    assert "sudo dnf install xcb-util-wm xcb-util-keysyms" in err


def test_nothing_is_reported_when_every_library_loads():
    assert qt_platform.check_xcb({"DISPLAY": ":0", "QT_QPA_PLATFORM": "xcb"}, loadable=lambda _: True) is None


@pytest.mark.parametrize(
    ("env", "xcb"),
    [
        ({"QT_QPA_PLATFORM": "offscreen", "DISPLAY": ":0"}, False),
        ({"QT_QPA_PLATFORM": "wayland;xcb", "DISPLAY": ":0"}, False),
        ({"QT_QPA_PLATFORM": "xcb:nograb", "DISPLAY": ":0"}, True),
        ({"DISPLAY": ":0"}, True),
        ({"DISPLAY": ":0", "WAYLAND_DISPLAY": "wayland-0"}, False),
        ({}, False),
    ],
)
def test_only_an_x11_start_is_checked(env, xcb):
    assert qt_platform.uses_xcb(env, platform="linux") is xcb
    assert not qt_platform.uses_xcb(env, platform="darwin")


def test_the_offscreen_path_never_probes_libraries():
    def probe(_soname: str) -> bool:
        raise AssertionError("probed")

    assert qt_platform.check_xcb({"QT_QPA_PLATFORM": "offscreen", "DISPLAY": ":0"}, loadable=probe) is None


@pytest.mark.skipif(not ON_LINUX or shutil.which("ldd") is None, reason="needs Linux and ldd")
def test_the_table_covers_every_x11_library_the_installed_plugin_links():
    import PySide6

    qt = Path(PySide6.__file__).parent / "Qt"
    plugin = [qt / "plugins" / "platforms" / "libqxcb.so", qt / "lib" / "libQt6XcbQpa.so.6"]
    listed = subprocess.run(["ldd", *map(str, plugin)], capture_output=True, text=True, check=True).stdout
    needed = {line.split()[0] for line in listed.splitlines() if "=>" in line}
    x11 = {name for name in needed if name.startswith(("libxcb", "libX11", "libxkbcommon"))}
    assert x11 and x11 <= set(qt_platform.XCB_LIBRARIES)
