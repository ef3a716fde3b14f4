"""The left column: "New chat" and the saved conversations (click opens, double-click renames).

A view only: it lists what it is given and signals what the user asked for;
`ChatController` opens, renames and deletes. Files that cannot be read are listed
last, greyed, with the reason as tooltip: clicking one shows the reason, and
Delete is offered when the file name is a valid conversation id.
"""

from __future__ import annotations

from collections.abc import Sequence

import qtawesome as qta
from PySide6.QtCore import QPoint, Qt, Signal
from PySide6.QtWidgets import (
    QAbstractItemView,
    QListWidget,
    QListWidgetItem,
    QMenu,
    QMessageBox,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

from .conversation_library import ConversationSummary
from .conversations import Unreadable

ID_ROLE = Qt.ItemDataRole.UserRole
UNREADABLE_ROLE = Qt.ItemDataRole.UserRole + 1  # the reason, on unreadable files' items


class ConversationSidebar(QWidget):
    newRequested = Signal()
    openRequested = Signal(str)  # conversation id
    renameRequested = Signal(str, str)  # conversation id, new title
    deleteRequested = Signal(str)  # conversation id (the user confirmed)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.list = QListWidget(objectName="conversationList")
        self.list.setEditTriggers(QAbstractItemView.EditTrigger.EditKeyPressed)
        self.list.setTextElideMode(Qt.TextElideMode.ElideRight)
        self.list.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.list.setContextMenuPolicy(Qt.ContextMenuPolicy.CustomContextMenu)
        self.list.customContextMenuRequested.connect(self._context_menu)
        self.list.itemClicked.connect(self._on_clicked)
        self.list.itemChanged.connect(
            lambda item: self.renameRequested.emit(str(item.data(ID_ROLE)), item.text())
        )
        self.list.itemDoubleClicked.connect(self.list.editItem)
        new_button = QPushButton(qta.icon("mdi6.plus"), "New chat", objectName="newChatButton")
        new_button.clicked.connect(self.newRequested)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(6, 6, 0, 6)
        layout.addWidget(new_button)
        layout.addWidget(self.list)
        self.setMinimumWidth(170)

    def show_conversations(
        self,
        conversations: Sequence[ConversationSummary],
        current_id: str,
        unreadable: Sequence[Unreadable] = (),
    ) -> None:
        """List `conversations` (newest first), select the open one, then the unreadable files."""
        widget = self.list
        widget.blockSignals(True)
        widget.clear()
        for conversation in conversations:
            item = QListWidgetItem(conversation.title)
            item.setData(ID_ROLE, conversation.id)
            item.setToolTip(f"{conversation.message_count} messages")
            item.setFlags(item.flags() | Qt.ItemFlag.ItemIsEditable)
            widget.addItem(item)
            if conversation.id == current_id:
                widget.setCurrentItem(item)
        for bad in unreadable:
            item = QListWidgetItem(qta.icon("mdi6.file-alert-outline"), f"{bad.name} (unreadable)")
            item.setData(ID_ROLE, bad.conversation_id)
            item.setData(UNREADABLE_ROLE, bad.reason)
            item.setToolTip(bad.reason)
            item.setForeground(self.palette().placeholderText())
            widget.addItem(item)
        widget.blockSignals(False)

    def _on_clicked(self, item: QListWidgetItem) -> None:
        if item.data(ID_ROLE) is not None:  # an unreadable file opens to its reason
            self.openRequested.emit(str(item.data(ID_ROLE)))

    def _context_menu(self, point: QPoint) -> None:
        item = self.list.itemAt(point)
        if item is None:
            return
        readable = item.data(UNREADABLE_ROLE) is None
        if not readable and item.data(ID_ROLE) is None:
            return  # not a name this app wrote: nothing it may rename or delete
        menu = QMenu(self)
        rename = menu.addAction(qta.icon("mdi6.pencil-outline"), "Rename") if readable else None
        delete = menu.addAction(qta.icon("mdi6.delete-outline"), "Delete")
        chosen = menu.exec(self.list.viewport().mapToGlobal(point))
        if chosen is None:
            return
        if chosen is rename:
            self.list.editItem(item)
        elif chosen is delete:
            answer = QMessageBox.question(self, "Delete conversation", f"Delete “{item.text()}”?")
            if answer == QMessageBox.StandardButton.Yes:
                self.deleteRequested.emit(str(item.data(ID_ROLE)))
