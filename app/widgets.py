"""Small widgets the window is assembled from: prompt box, error banner, load panel,
edit banner, provenance legend and the system prompt dialog.

They hold no chat or model state: they show what a controller tells them and
signal what the user did.
"""

from __future__ import annotations

import qtawesome as qta
from PySide6.QtCore import QMimeData, Qt, Signal
from PySide6.QtGui import QKeyEvent
from PySide6.QtWidgets import (
    QDialog,
    QDialogButtonBox,
    QFrame,
    QHBoxLayout,
    QLabel,
    QPlainTextEdit,
    QProgressBar,
    QPushButton,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from . import theme


class PromptEdit(QPlainTextEdit):
    """The input box: Enter sends, Shift+Enter inserts a newline, Esc cancels an edit; a paste
    is signalled (the engine reads ahead at once, `read_ahead.py`)."""

    submitted = Signal()
    escaped = Signal()
    pasted = Signal()  # text was pasted or dropped in (after it was inserted)

    def insertFromMimeData(self, source: QMimeData) -> None:
        super().insertFromMimeData(source)
        self.pasted.emit()

    def keyPressEvent(self, event: QKeyEvent) -> None:
        if event.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter):
            if event.modifiers() & Qt.KeyboardModifier.ShiftModifier:
                self.insertPlainText("\n")
            else:
                self.submitted.emit()
            return
        if event.key() == Qt.Key.Key_Escape:
            self.escaped.emit()
            return
        super().keyPressEvent(event)


class PromptBox(QWidget):
    """The prompt with its Send and Stop buttons."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.edit = PromptEdit(objectName="promptEdit")
        self.edit.setPlaceholderText("Message the model…  (Enter to send, Shift+Enter for a new line)")
        self.edit.setFixedHeight(84)
        self.send_button = QPushButton(qta.icon("mdi6.send", color="white"), "Send", objectName="sendButton")
        self.stop_button = QPushButton(qta.icon("mdi6.stop", color="white"), "Stop", objectName="stopButton")
        buttons = QVBoxLayout()
        buttons.addWidget(self.send_button)
        buttons.addWidget(self.stop_button)
        row = QHBoxLayout(self)
        row.setContentsMargins(12, 0, 12, 0)
        row.addWidget(self.edit, 1)
        row.addLayout(buttons)


class ErrorBanner(QFrame):
    """A dismissable line above the transcript for what went wrong."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent, objectName="errorBanner")
        self.text = QLabel(objectName="errorText")
        self.text.setWordWrap(True)
        self.text.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        dismiss = QToolButton()
        dismiss.setIcon(qta.icon("mdi6.close"))
        dismiss.setToolTip("Dismiss")
        dismiss.clicked.connect(self.hide)
        layout = QHBoxLayout(self)
        layout.addWidget(QLabel(pixmap=qta.icon("mdi6.alert-circle-outline", color="#dc2626").pixmap(18)))
        layout.addWidget(self.text, 1)
        layout.addWidget(dismiss)
        self.hide()

    def show_message(self, message: str) -> None:
        self.text.setText(message)
        self.show()


class LoadPanel(QFrame):
    """Stage, progress bar and Cancel while models load."""

    cancelRequested = Signal()

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent, objectName="loadPanel")
        self.stage = QLabel("Loading…", objectName="loadStage")
        self.progress = QProgressBar(objectName="loadProgress")
        self.progress.setTextVisible(True)
        self.cancel_button = QPushButton("Cancel", objectName="loadCancelButton")
        self.cancel_button.clicked.connect(self.cancelRequested)
        layout = QHBoxLayout(self)
        layout.addWidget(self.stage, 1)
        layout.addWidget(self.progress, 1)
        layout.addWidget(self.cancel_button)
        self.hide()

    def begin(self, text: str) -> None:
        self.stage.setText(text)
        self.progress.setRange(0, 0)
        self.show()

    def show_progress(self, stage: str, done: int, total: int) -> None:
        """`total` 0 means unknown (a busy bar); byte counts are shown in MiB."""
        self.stage.setText(stage)
        if total > 0:
            self.progress.setRange(0, 1000)
            self.progress.setValue(int(1000 * done / total))
            self.progress.setFormat(f"%p%  ({done / 2**20:.0f} / {total / 2**20:.0f} MiB)")
        else:
            self.progress.setRange(0, 0)


class EditBanner(QLabel):
    """Says that Send will replace an earlier message."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent, objectName="editBanner")
        self.setText("  Editing an earlier message: Send replaces it and everything after it (Esc cancels)")
        self.hide()


class ProvenanceLegend(QLabel):
    """The colour key under the transcript."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent, objectName="legendLabel")
        self.setTextFormat(Qt.TextFormat.RichText)

    def set_tints(self, tints: theme.Tints) -> None:
        self.setText(legend_html(tints))


def legend_html(tints: theme.Tints) -> str:
    def chip(color: str, label: str, underline: bool = False) -> str:
        style = f"background-color:{color};"
        if underline:
            style += " text-decoration: underline; color: inherit;"
        return f'<span style="{style}">&nbsp;{label}&nbsp;</span>'

    return (
        chip(tints.accepted.name(), "accepted draft")
        + " &nbsp; "
        + chip(tints.corrected.name(), "corrected by target", underline=True)
        + " &nbsp; "
        + chip(tints.bonus.name(), "bonus")
        + " &nbsp; target (no tint) &nbsp;·&nbsp; hover a token for details"
    )


class SystemPromptDialog(QDialog):
    def __init__(self, text: str, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("System prompt")
        self.editor = QPlainTextEdit(text, objectName="systemPromptEdit")
        self.editor.setPlaceholderText("e.g. You are a concise assistant who answers with code first.")
        buttons = QDialogButtonBox(
            QDialogButtonBox.StandardButton.Ok | QDialogButtonBox.StandardButton.Cancel
        )
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        layout = QVBoxLayout(self)
        layout.addWidget(QLabel("Applies to this conversation and becomes the default for new chats."))
        layout.addWidget(self.editor)
        layout.addWidget(buttons)
        self.resize(520, 300)
