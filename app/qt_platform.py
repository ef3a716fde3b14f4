"""Before Qt starts on X11: are the xcb platform plugin's system libraries installed?

PySide6's wheels bring Qt but not the X11 libraries its `xcb` plugin links against.
On a fresh Debian 12 with a display, Qt aborts the whole process (`Could not load the
Qt platform plugin "xcb"`, then SIGABRT) and names one library at a time. So the app
looks for them first — `dlopen` by soname searches exactly where the dynamic loader
would — and prints one line naming every missing package, for Debian/Ubuntu and Fedora.
The sonames are what `ldd` lists for PySide6's `libqxcb.so` and `libQt6XcbQpa.so.6`
(tests/test_qt_platform.py checks this table against `ldd` where it is available).
Qt-free on purpose: it must run before anything creates a QGuiApplication.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Callable, Mapping

# soname -> (Debian/Ubuntu package, Fedora package)
XCB_LIBRARIES: dict[str, tuple[str, str]] = {
    "libxcb.so.1": ("libxcb1", "libxcb"),
    "libxcb-cursor.so.0": ("libxcb-cursor0", "xcb-util-cursor"),
    "libxcb-icccm.so.4": ("libxcb-icccm4", "xcb-util-wm"),
    "libxcb-keysyms.so.1": ("libxcb-keysyms1", "xcb-util-keysyms"),
    "libxcb-image.so.0": ("libxcb-image0", "xcb-util-image"),
    "libxcb-render-util.so.0": ("libxcb-render-util0", "xcb-util-renderutil"),
    "libxcb-util.so.1": ("libxcb-util1", "xcb-util"),
    "libxcb-randr.so.0": ("libxcb-randr0", "libxcb"),
    "libxcb-render.so.0": ("libxcb-render0", "libxcb"),
    "libxcb-shape.so.0": ("libxcb-shape0", "libxcb"),
    "libxcb-shm.so.0": ("libxcb-shm0", "libxcb"),
    "libxcb-sync.so.1": ("libxcb-sync1", "libxcb"),
    "libxcb-xfixes.so.0": ("libxcb-xfixes0", "libxcb"),
    "libxcb-xkb.so.1": ("libxcb-xkb1", "libxcb"),
    "libxkbcommon.so.0": ("libxkbcommon0", "libxkbcommon"),
    "libxkbcommon-x11.so.0": ("libxkbcommon-x11-0", "libxkbcommon-x11"),
    "libX11.so.6": ("libx11-6", "libX11"),
    "libX11-xcb.so.1": ("libx11-xcb1", "libX11-xcb"),
    "libEGL.so.1": ("libegl1", "libglvnd-egl"),
    "libfontconfig.so.1": ("libfontconfig1", "fontconfig"),
    "libdbus-1.so.3": ("libdbus-1-3", "dbus-libs"),
}


def _loadable(soname: str) -> bool:
    try:
        ctypes.CDLL(soname)
    except OSError:
        return False
    return True


def uses_xcb(env: Mapping[str, str], platform: str = sys.platform) -> bool:
    """Whether Qt would start its xcb plugin here (Linux, an X display, not Wayland or offscreen)."""
    if not platform.startswith("linux"):
        return False
    requested = env.get("QT_QPA_PLATFORM", "").strip()
    if requested:
        # "xcb", "xcb:option=…" or a fallback list such as "wayland;xcb": the first one is tried first.
        return requested.split(";")[0].split(":")[0].strip() == "xcb" and bool(env.get("DISPLAY"))
    if env.get("WAYLAND_DISPLAY") or env.get("XDG_SESSION_TYPE") == "wayland":
        return False  # Qt 6 prefers its Wayland plugin in a Wayland session
    return bool(env.get("DISPLAY"))


def missing_xcb_libraries(loadable: Callable[[str], bool] | None = None) -> list[str]:
    probe = loadable or _loadable  # looked up per call, so the module's probe can be replaced
    return [soname for soname in XCB_LIBRARIES if not probe(soname)]


def install_hint(missing: list[str]) -> str:
    """One line: what is missing and the packages that bring it, Debian/Ubuntu and Fedora."""
    debian = " ".join(dict.fromkeys(XCB_LIBRARIES[s][0] for s in missing))
    fedora = " ".join(dict.fromkeys(XCB_LIBRARIES[s][1] for s in missing))
    return (
        f"specdec: Qt's X11 plugin needs system libraries that are missing ({', '.join(missing)}): "
        f"install them with `sudo apt install {debian}` (Debian/Ubuntu) or `sudo dnf install {fedora}` "
        f"(Fedora), or run under Wayland (QT_QPA_PLATFORM=wayland)"
    )


def check_xcb(env: Mapping[str, str] | None = None, loadable: Callable[[str], bool] | None = None) -> str | None:
    """The one-line hint when Qt would start on X11 without its libraries; None when all is well."""
    if not uses_xcb(os.environ if env is None else env):
        return None
    missing = missing_xcb_libraries(loadable)
    return install_hint(missing) if missing else None
