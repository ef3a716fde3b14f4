"""Light and dark themes: a Fusion palette, a stylesheet from resources, provenance tints.

"system" follows the desktop's colour scheme (Qt's styleHints, live). The tints
are chosen per theme so that text stays readable on them: pale backgrounds under
dark text in light mode, deep ones under light text in dark mode. Corrections also
get an underline, so they stay distinguishable without colour vision.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources

from PySide6.QtCore import Qt
from PySide6.QtGui import QColor, QGuiApplication, QIcon, QPalette, QPixmap
from PySide6.QtWidgets import QApplication


@dataclass(frozen=True)
class Tints:
    """Backgrounds for each token source ("target" tokens stay untinted)."""

    accepted: QColor
    corrected: QColor
    corrected_line: QColor
    bonus: QColor
    code_background: QColor
    muted_text: QColor
    user_bubble: QColor
    theme: str = "light"  # the theme they belong to (code colours follow it)

    def for_source(self, source: str) -> QColor | None:
        return {"accepted": self.accepted, "corrected": self.corrected, "bonus": self.bonus}.get(source)


LIGHT_TINTS = Tints(
    accepted=QColor("#c6efce"),
    corrected=QColor("#ffd59e"),
    corrected_line=QColor("#d9480f"),
    bonus=QColor("#cfe2ff"),
    code_background=QColor("#f3f4f6"),
    muted_text=QColor("#6b7280"),
    user_bubble=QColor("#eef2ff"),
)
DARK_TINTS = Tints(
    accepted=QColor("#1e5631"),
    corrected=QColor("#7a4a0e"),
    corrected_line=QColor("#ff8a4c"),
    bonus=QColor("#1f3f73"),
    code_background=QColor("#1b1f24"),
    muted_text=QColor("#9ca3af"),
    user_bubble=QColor("#262b36"),
    theme="dark",
)


def system_is_dark() -> bool:
    hints = QGuiApplication.styleHints()
    return hints.colorScheme() == Qt.ColorScheme.Dark


def resolve(theme: str) -> str:
    """ "system" -> "light" or "dark"."""
    if theme in ("light", "dark"):
        return theme
    return "dark" if system_is_dark() else "light"


def tints(resolved: str) -> Tints:
    return DARK_TINTS if resolved == "dark" else LIGHT_TINTS


def _palette(resolved: str) -> QPalette:
    palette = QPalette()
    if resolved == "dark":
        colors = {
            QPalette.ColorRole.Window: "#202328",
            QPalette.ColorRole.WindowText: "#e6e6e6",
            QPalette.ColorRole.Base: "#17191d",
            QPalette.ColorRole.AlternateBase: "#23262c",
            QPalette.ColorRole.Text: "#e6e6e6",
            QPalette.ColorRole.Button: "#2a2e35",
            QPalette.ColorRole.ButtonText: "#e6e6e6",
            QPalette.ColorRole.Highlight: "#3b82f6",
            QPalette.ColorRole.HighlightedText: "#ffffff",
            QPalette.ColorRole.ToolTipBase: "#2a2e35",
            QPalette.ColorRole.ToolTipText: "#e6e6e6",
            QPalette.ColorRole.PlaceholderText: "#8b929c",
            QPalette.ColorRole.Link: "#7cb4ff",
            QPalette.ColorRole.Mid: "#3a3f47",
        }
    else:
        colors = {
            QPalette.ColorRole.Window: "#f5f6f8",
            QPalette.ColorRole.WindowText: "#1f2328",
            QPalette.ColorRole.Base: "#ffffff",
            QPalette.ColorRole.AlternateBase: "#f0f2f5",
            QPalette.ColorRole.Text: "#1f2328",
            QPalette.ColorRole.Button: "#eceef1",
            QPalette.ColorRole.ButtonText: "#1f2328",
            QPalette.ColorRole.Highlight: "#2563eb",
            QPalette.ColorRole.HighlightedText: "#ffffff",
            QPalette.ColorRole.ToolTipBase: "#ffffff",
            QPalette.ColorRole.ToolTipText: "#1f2328",
            QPalette.ColorRole.PlaceholderText: "#8b929c",
            QPalette.ColorRole.Link: "#1d4ed8",
            QPalette.ColorRole.Mid: "#d0d4da",
        }
    for role, color in colors.items():
        palette.setColor(role, QColor(color))
    disabled = QColor("#6b7280") if resolved == "dark" else QColor("#a0a6ae")
    for role in (QPalette.ColorRole.Text, QPalette.ColorRole.ButtonText, QPalette.ColorRole.WindowText):
        palette.setColor(QPalette.ColorGroup.Disabled, role, disabled)
    return palette


def stylesheet(resolved: str) -> str:
    return resources.files("specdec_resources").joinpath(f"{resolved}.qss").read_text(encoding="utf-8")


def apply(app: QApplication, theme: str) -> str:
    """Style the whole application; returns the resolved theme ("light" or "dark")."""
    resolved = resolve(theme)
    app.setStyle("Fusion")  # the same widgets on every platform, so the stylesheets fit
    app.setPalette(_palette(resolved))
    app.setStyleSheet(stylesheet(resolved))
    return resolved


def app_icon() -> QIcon:
    data = resources.files("specdec_resources").joinpath("specdec.svg").read_bytes()
    pixmap = QPixmap()
    pixmap.loadFromData(data, "SVG")
    return QIcon(pixmap)
