"""Live gauges drawn with QPainter: a radial gauge with an optional marker, and a sparkline.

No images and no chart library: a few arcs and a polyline repaint in well under a
millisecond, which matters because they update at every verify step while the
UI thread must stay free for typing.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from PySide6.QtCore import QPointF, QRectF, QSize, Qt
from PySide6.QtGui import QColor, QFont, QPainter, QPainterPath, QPen
from PySide6.QtWidgets import QSizePolicy, QWidget

_START_DEG = 225  # the arc runs clockwise from 7:30 to 4:30, like a speedometer
_SPAN_DEG = 270


class Gauge(QWidget):
    """A value on a 270° arc, with a caption, a formatted reading and an optional marker.

    `marker` (e.g. the theoretical speedup bound) is drawn as a tick on the arc so the
    measured value can be read against it.
    """

    def __init__(
        self,
        caption: str,
        maximum: float,
        fmt: Callable[[float], str],
        color: QColor,
        parent: QWidget | None = None,
    ) -> None:
        super().__init__(parent)
        self._caption = caption
        self._maximum = maximum
        self._fmt = fmt
        self._color = color
        self._value = 0.0
        self._marker: float | None = None
        self._active = False  # no reading yet: show a dash instead of a misleading 0
        self.setSizePolicy(QSizePolicy.Policy.Preferred, QSizePolicy.Policy.Fixed)
        self.setMinimumSize(112, 118)

    def sizeHint(self) -> QSize:
        return QSize(124, 124)

    def value(self) -> float:
        return self._value

    def marker(self) -> float | None:
        return self._marker

    def text(self) -> str:
        return self._fmt(self._value) if self._active else "–"

    def set_value(self, value: float, marker: float | None = None) -> None:
        self._value = max(0.0, float(value))
        self._marker = marker
        self._active = True
        # Let the scale grow for fast machines instead of pinning at the top.
        while self._value > self._maximum:
            self._maximum *= 2
        self.setToolTip(self._tooltip())
        self.update()

    def clear(self) -> None:
        self._value = 0.0
        self._marker = None
        self._active = False
        self.setToolTip("")
        self.update()

    def _tooltip(self) -> str:
        text = f"{self._caption}: {self._fmt(self._value)}"
        if self._marker is not None:
            text += f" (theoretical {self._fmt(self._marker)})"
        return text

    def paintEvent(self, event: object) -> None:
        painter = QPainter(self)
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        palette = self.palette()
        caption_height = 18
        side = min(self.width() - 16, self.height() - caption_height - 2)
        rect = QRectF((self.width() - side) / 2, 6, side, side)
        track = QColor(palette.mid().color())
        pen = QPen(track, 8, Qt.PenStyle.SolidLine, Qt.PenCapStyle.RoundCap)
        painter.setPen(pen)
        painter.drawArc(rect, _START_DEG * 16, -_SPAN_DEG * 16)
        if self._active:
            fraction = min(1.0, self._value / self._maximum) if self._maximum > 0 else 0.0
            pen.setColor(self._color)
            painter.setPen(pen)
            painter.drawArc(rect, _START_DEG * 16, int(-_SPAN_DEG * fraction * 16))
        if self._active and self._marker is not None and self._maximum > 0:
            self._draw_marker(painter, rect, min(1.0, self._marker / self._maximum))
        painter.setPen(palette.text().color())
        reading = QFont(self.font())
        reading.setPointSizeF(reading.pointSizeF() * 1.25)
        reading.setBold(True)
        painter.setFont(reading)
        painter.drawText(rect, Qt.AlignmentFlag.AlignCenter, self.text())
        caption = QFont(self.font())
        caption.setPointSizeF(caption.pointSizeF() * 0.85)
        painter.setFont(caption)
        painter.setPen(palette.placeholderText().color())
        below = QRectF(0, self.height() - caption_height, self.width(), caption_height)
        painter.drawText(below, Qt.AlignmentFlag.AlignHCenter | Qt.AlignmentFlag.AlignVCenter, self._caption)
        painter.end()

    def _draw_marker(self, painter: QPainter, rect: QRectF, fraction: float) -> None:
        angle = math.radians(_START_DEG - _SPAN_DEG * fraction)
        center = rect.center()
        radius = rect.width() / 2
        outer = QPointF(
            center.x() + (radius + 7) * math.cos(angle), center.y() - (radius + 7) * math.sin(angle)
        )
        inner = QPointF(
            center.x() + (radius - 7) * math.cos(angle), center.y() - (radius - 7) * math.sin(angle)
        )
        painter.setPen(QPen(self.palette().text().color(), 2, Qt.PenStyle.SolidLine, Qt.PenCapStyle.RoundCap))
        painter.drawLine(inner, outer)


class Sparkline(QWidget):
    """Tokens/s over the current message, as a small filled polyline."""

    def __init__(self, color: QColor, capacity: int = 120, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self._color = color
        self._capacity = capacity
        self._values: list[float] = []
        self.setMinimumHeight(40)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)

    def sizeHint(self) -> QSize:
        return QSize(200, 44)

    def values(self) -> list[float]:
        return list(self._values)

    def add(self, value: float) -> None:
        self._values.append(float(value))
        if len(self._values) > self._capacity:
            # Halve the resolution instead of scrolling: the whole message stays visible.
            self._values = [max(a, b) for a, b in zip(self._values[::2], self._values[1::2], strict=False)]
        self.update()

    def clear(self) -> None:
        self._values = []
        self.update()

    def paintEvent(self, event: object) -> None:
        painter = QPainter(self)
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        area = QRectF(self.rect()).adjusted(2, 4, -2, -2)
        painter.setPen(QPen(self.palette().mid().color(), 1))
        painter.drawLine(area.bottomLeft(), area.bottomRight())
        if len(self._values) >= 2:
            top = max(self._values) or 1.0
            step = area.width() / (len(self._values) - 1)
            points = [
                QPointF(area.left() + i * step, area.bottom() - area.height() * v / top)
                for i, v in enumerate(self._values)
            ]
            fill = QPainterPath(QPointF(area.left(), area.bottom()))
            for p in points:
                fill.lineTo(p)
            fill.lineTo(QPointF(points[-1].x(), area.bottom()))
            shade = QColor(self._color)
            shade.setAlpha(60)
            painter.fillPath(fill, shade)
            painter.setPen(QPen(self._color, 1.6))
            painter.drawPolyline(points)
        painter.end()
