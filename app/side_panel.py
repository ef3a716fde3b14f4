"""The right-hand panel: live gauges for the running answer, and the generation settings."""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QColor
from PySide6.QtWidgets import (
    QComboBox,
    QDoubleSpinBox,
    QFormLayout,
    QFrame,
    QGridLayout,
    QGroupBox,
    QLabel,
    QPushButton,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from specdec_core import MAX_DRAFT_LENGTH, GenerationParams, GenerationStats, StepEvent

from .gauges import Gauge, Sparkline
from .settings import AppSettings


def answer_footer(stats: GenerationStats, draft_name: str) -> str:
    """The line under an answer: "Draft: … · accepted A/P (R%) · S× faster · T tok/s"."""
    parts = [f"Draft: {draft_name}"]
    if stats.new_tokens == 0 and stats.stop_reason == "cancelled":
        return f"{parts[0]} · stopped before the first token"  # no speed to report
    if stats.proposed:
        parts.append(f"accepted {stats.accepted}/{stats.proposed} ({stats.acceptance_rate:.0%})")
    else:
        parts.append("target alone")
    speedup = stats.measured_speedup
    if not stats.speedup_known:
        parts.append("speedup unknown")
    elif speedup > 0:
        parts.append(f"{speedup:.1f}× faster" if speedup >= 1.0 else f"{speedup:.2f}× (slower)")
    parts.append(f"{stats.tokens_per_second:.1f} tok/s")
    parts.append(f"{stats.new_tokens} tokens")
    if stats.stop_reason == "cancelled":
        parts.append("stopped")
    elif stats.stop_reason == "context_full":
        parts.append("stopped: the model's context is full")
    elif stats.stop_reason == "server_stopped":
        parts.append(f"stopped: {stats.note}")
    return " · ".join(parts)


EXACTNESS_TIP = (
    "Checked when the model loaded: the widest verify the engine issues, compared row by row "
    "with plain target steps at every thread count the engine may use"
)


class GaugePanel(QWidget):
    """tokens/s, acceptance and speedup gauges, mean accepted length, current k, a sparkline."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.tokens_per_second = Gauge("tokens / s", 40.0, lambda v: f"{v:.1f}", QColor("#3b82f6"))
        self.tokens_per_second.setObjectName("tokensPerSecondGauge")
        self.acceptance = Gauge("acceptance", 1.0, lambda v: f"{v:.0%}", QColor("#22c55e"))
        self.acceptance.setObjectName("acceptanceGauge")
        self.speedup = Gauge("speedup vs target", 4.0, lambda v: f"{v:.2f}×", QColor("#a855f7"))
        self.speedup.setObjectName("speedupGauge")
        self.mean_length = QLabel("–")
        self.current_k = QLabel("–")
        self.bound = QLabel("–")
        for label in (self.mean_length, self.current_k, self.bound):
            label.setAlignment(Qt.AlignmentFlag.AlignRight)
            label.setMinimumWidth(label.fontMetrics().horizontalAdvance("12 · pinned"))
        self.sparkline = Sparkline(QColor("#3b82f6"))
        self.sparkline.setObjectName("tokensPerSecondSparkline")
        self.sparkline.setToolTip("tokens/s over this answer")
        self.footer = QLabel("")
        self.footer.setObjectName("footerStats")
        self.footer.setWordWrap(True)
        self.footer.setMinimumHeight(self.footer.fontMetrics().height() * 3)
        self.footer.setAlignment(Qt.AlignmentFlag.AlignTop | Qt.AlignmentFlag.AlignLeft)
        self.exactness = QLabel("", objectName="exactnessLabel")  # the loaded pair's self-check
        self.exactness.setWordWrap(True)
        self.exactness.setToolTip(EXACTNESS_TIP)

        grid = QGridLayout()
        grid.addWidget(self.tokens_per_second, 0, 0)
        grid.addWidget(self.acceptance, 0, 1)
        grid.addWidget(self.speedup, 1, 0)
        figures = QFormLayout()
        figures.addRow("per step", self.mean_length)
        figures.addRow("current k", self.current_k)
        figures.addRow("theory", self.bound)
        holder = QWidget()
        holder.setLayout(figures)
        grid.addWidget(holder, 1, 1)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addLayout(grid)
        layout.addWidget(self.sparkline)
        layout.addWidget(self.footer)
        layout.addWidget(self.exactness)
        self.speedup.setToolTip(
            "Measured speedup against the target alone (timed on this machine); "
            "the tick is the theoretical speedup for the measured acceptance and cost ratio"
        )

    def reset(self) -> None:
        for gauge in (self.tokens_per_second, self.acceptance, self.speedup):
            gauge.clear()
        self.sparkline.clear()
        self.mean_length.setText("–")
        self.current_k.setText("–")
        self.bound.setText("–")

    def show_update(self, update: StepEvent, pinned_k: int | None, speculating: bool) -> None:
        """The running figures after a verify step (the engine's, never recomputed here)."""
        self.tokens_per_second.set_value(update.tokens_per_second)
        self.acceptance.set_value(update.acceptance_rate)
        self.speedup.set_value(update.measured_speedup, marker=update.theoretical_speedup)
        self.mean_length.setText(f"{update.mean_accepted_length:.2f}")
        if not speculating:
            self.current_k.setText("off")
        else:
            self.current_k.setText(f"{update.k} · {'pinned' if pinned_k is not None else 'auto'}")
        self.bound.setText(f"{update.theoretical_speedup:.2f}×")
        self.sparkline.add(update.tokens_per_second)

    def show_final(self, stats: GenerationStats, footer: str) -> None:
        self.footer.setText(footer)
        if stats.new_tokens == 0:  # stopped while reading the prompt: no figure means anything
            self.reset()
            return
        self.tokens_per_second.set_value(stats.tokens_per_second)
        self.acceptance.set_value(stats.acceptance_rate)
        self.speedup.set_value(stats.measured_speedup, marker=stats.theoretical_speedup)
        self.mean_length.setText(f"{stats.mean_accepted_length:.2f}")
        self.bound.setText(f"{stats.theoretical_speedup:.2f}×")


class GenerationSettings(QGroupBox):
    """Max new tokens, temperature, top-p, top-k, seed, draft length; saved as they change."""

    systemPromptRequested = Signal()

    def __init__(self, settings: AppSettings, parent: QWidget | None = None) -> None:
        super().__init__("Generation", parent)
        self._settings = settings
        self.max_new_tokens = QSpinBox(objectName="maxNewTokensSpin")
        self.max_new_tokens.setRange(1, 32768)
        self.max_new_tokens.setValue(settings.max_new_tokens)
        self.temperature = QDoubleSpinBox(objectName="temperatureSpin")
        self.temperature.setRange(0.0, 2.0)
        self.temperature.setSingleStep(0.1)
        self.temperature.setValue(settings.temperature)
        self.temperature.setToolTip("0 = greedy: exactly the target's own greedy answer")
        self.top_p = QDoubleSpinBox(objectName="topPSpin")
        self.top_p.setRange(0.01, 1.0)
        self.top_p.setSingleStep(0.05)
        self.top_p.setValue(settings.top_p)
        self.top_k = QSpinBox(objectName="topKSpin")
        self.top_k.setRange(0, 10000)
        self.top_k.setSpecialValueText("off")
        self.top_k.setValue(settings.top_k)
        self.seed = QSpinBox(objectName="seedSpin")
        self.seed.setRange(-1, 2**31 - 1)
        self.seed.setSpecialValueText("random")
        self.seed.setValue(settings.seed)
        self.draft_length = QComboBox(objectName="draftLengthMenu")
        self.draft_length.addItem("auto (adaptive)", 0)
        for k in range(1, MAX_DRAFT_LENGTH + 1):
            self.draft_length.addItem(f"pinned k = {k}", k)
        self.draft_length.setCurrentIndex(max(0, self.draft_length.findData(settings.draft_length)))
        self.draft_length.setToolTip("auto picks k each step from measured acceptance and costs")
        self.system_button = QPushButton("System prompt…", objectName="systemPromptButton")
        self.system_button.clicked.connect(self.systemPromptRequested)

        form = QFormLayout(self)
        form.addRow("Max new tokens", self.max_new_tokens)
        form.addRow("Temperature", self.temperature)
        form.addRow("Top-p", self.top_p)
        form.addRow("Top-k", self.top_k)
        form.addRow("Seed", self.seed)
        form.addRow("Draft length", self.draft_length)
        form.addRow(self.system_button)
        for spin in (self.max_new_tokens, self.temperature, self.top_p, self.top_k, self.seed):
            spin.valueChanged.connect(self._save)
        self.draft_length.currentIndexChanged.connect(self._save)

    def pinned_k(self) -> int | None:
        k = int(self.draft_length.currentData())
        return k or None

    def params(self) -> GenerationParams:
        seed = self.seed.value()
        return GenerationParams(
            max_new_tokens=self.max_new_tokens.value(),
            temperature=self.temperature.value(),
            top_k=self.top_k.value(),
            top_p=self.top_p.value(),
            seed=None if seed < 0 else seed,
            draft_length=self.pinned_k(),
            max_draft_length=max(8, self.pinned_k() or 0),
        )

    def _save(self) -> None:
        s = self._settings
        s.max_new_tokens = self.max_new_tokens.value()
        s.temperature = self.temperature.value()
        s.top_p = self.top_p.value()
        s.top_k = self.top_k.value()
        s.seed = self.seed.value()
        s.draft_length = self.pinned_k() or 0


class SidePanel(QFrame):
    def __init__(self, settings: AppSettings, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("gaugePanel")
        self.gauges = GaugePanel()
        self.generation = GenerationSettings(settings)
        layout = QVBoxLayout(self)
        layout.addWidget(self.gauges)
        layout.addWidget(self.generation)
        layout.addStretch(1)
        self.setMinimumWidth(270)
        self.setMaximumWidth(360)
