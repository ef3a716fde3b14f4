"""The toolbar of model choices: target, draft, device, precision, and what actually runs.

It shows the menus and reports what the user chose as signals; what to load and
when is `ModelController`'s business. "Open model folder…", "Open GGUF file…" and
"Hub id…" end both model menus and ask for a reference with a dialog.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import qtawesome as qta
from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QAction
from PySide6.QtWidgets import QComboBox, QFileDialog, QInputDialog, QLabel, QToolBar, QWidget

from specdec_core import DEVICES, PRECISIONS, Compatibility

from . import catalog_info

# What each precision costs in fidelity, shown on the precision menu's items.
PRECISION_COSTS = {
    "auto": "The fastest that fits. On the CPU a Q4_K_M GGUF runs as stored, other GGUFs re-quantized to "
    "int4, and a bf16/fp16 folder as llama.cpp's Q4_K_M blocks where they run as fast; the label "
    "beside the menu says which, and what it costs.",
    "gguf": "A GGUF file's own blocks, as stored: the weights in the file, nothing rounded again (CPU).",
    "int4": "Re-quantized to 4 bits at load (CPU, fastest): rounds the file's weights again, so answers "
    "drift slightly from the file's; `specdec eval` measures how far.",
    "int8": "Re-quantized to 8 bits at load (CPU): rounds the weights again; `specdec eval` measures how far.",
    "q4_k_m": "A bf16/fp16 folder quantized once into llama.cpp's Q4_K_M blocks by llama.cpp's own "
    "quantizers, cached, and measured against the folder when made: the label gives its KL (CPU).",
    "q8_0": "A bf16/fp16 folder quantized once into llama.cpp's Q8_0 blocks, cached: near the source, "
    "twice q4_k_m's bytes a step; the label gives its KL (CPU).",
    "fp32": "The source's weights exactly, widened to fp32: the reference, and the slowest.",
    "bf16": "Half precision: as stored for a bf16 checkpoint; a GGUF's or fp32 weights are rounded.",
    "fp16": "Half precision: as stored for an fp16 checkpoint; other weights are rounded.",
    "nf4": "4-bit on the GPU (bitsandbytes): the weights re-quantized.",
}

OPEN_FOLDER = "::open-folder"
OPEN_GGUF = "::open-gguf"
HUB_ID = "::hub-id"
SERVER = "::server"  # the target menu only: a served engine's address
LOCAL_SERVER = "::local-server"  # the target menu only: serve the target with llama.cpp's server here
OPEN_ITEMS = (
    ("mdi6.folder-open-outline", "Open model folder…", OPEN_FOLDER),
    ("mdi6.file-outline", "Open GGUF file…", OPEN_GGUF),
    ("mdi6.cloud-download-outline", "Hub id…", HUB_ID),
)
DRAFT_LABELS = {"ngram": "n-gram (no model)", "none": "None (target alone)"}
TOOLTIP = Qt.ItemDataRole.ToolTipRole


def short_ref(ref: str) -> str:
    """A folder or file is shown by its name; catalog names and hub ids as they are."""
    path = Path(ref)
    return path.name if (path.is_absolute() or ref.startswith((".", "~"))) and path.name else ref


def choose_model_ref(parent: QWidget, kind: str) -> str:
    """Ask for a folder, a GGUF file, a hub id or a server address; "" when the user cancels."""
    if kind == SERVER:
        text, ok = QInputDialog.getText(
            parent,
            "Server",
            "OpenAI-compatible server (llama.cpp, vLLM, SGLang), e.g. http://127.0.0.1:8080/v1\n"
            "API key: the SPECDEC_API_KEY environment variable or the keyring.",
        )
        return text.strip() if ok else ""
    if kind == OPEN_FOLDER:
        return QFileDialog.getExistingDirectory(parent, "Open a Hugging Face model folder")
    if kind == OPEN_GGUF:
        path, _ = QFileDialog.getOpenFileName(parent, "Open a GGUF file", "", "GGUF models (*.gguf)")
        return path
    text, ok = QInputDialog.getText(
        parent, "Hub id", "Hugging Face hub id (e.g. Qwen/Qwen2.5-0.5B-Instruct):"
    )
    return text.strip() if ok else ""


def ask_llama_server(parent: QWidget, target: str, draft: str, remembered: str) -> str | None:
    """The llama-server binary to serve `target` (and `draft`) with: "" for the default; None: cancelled."""
    text, ok = QInputDialog.getText(
        parent,
        "Start llama.cpp's server",
        f"Serve {short_ref(target)} (a .gguf) with the draft {short_ref(draft)} (when a .gguf) by\n"
        "llama.cpp's server on 127.0.0.1; it stops when the window closes or another model loads.\n"
        "llama-server binary (empty: $SPECDEC_LLAMA_SERVER, else llama-server on PATH):",
        text=remembered,
    )
    return text.strip() if ok else None


class ModelToolbar(QToolBar):
    targetChosen = Signal(str)  # a model ref
    localServerRequested = Signal()  # "Start llama.cpp's server…": serve the current target here
    draftChosen = Signal(str, bool)  # a draft spec, and whether it came from a dialog
    placementChosen = Signal(str, str)  # device, precision

    def __init__(self, device: str, precision: str, parent: QWidget | None = None) -> None:
        super().__init__("Models", parent)
        self.setObjectName("mainToolbar")
        self.setMovable(False)
        self.setToolButtonStyle(Qt.ToolButtonStyle.ToolButtonTextBesideIcon)
        self._target = ""
        self._draft = ""
        self.target_menu = self._combo("targetMenu", 22, "Target model: the one whose answer you get")
        self.target_menu.activated.connect(self._on_target_activated)
        self.draft_menu = self._combo("draftMenu", 20, "Draft: proposes tokens for the target to verify")
        self.draft_menu.activated.connect(self._on_draft_activated)
        self.device_menu = self._combo("deviceMenu", 0, "Device (auto: CUDA when available)")
        self.device_menu.addItems(list(DEVICES))
        self.device_menu.setCurrentText(device)
        self.device_menu.activated.connect(self._on_placement)
        self.precision_menu = self._combo(
            "precisionMenu", 0, "Precision (auto: the fastest that fits; CPU int4 and int8 are exact per token)"
        )
        self.precision_menu.addItems(list(PRECISIONS))
        for index, name in enumerate(PRECISIONS):
            self.precision_menu.setItemData(index, PRECISION_COSTS.get(name, ""), Qt.ItemDataRole.ToolTipRole)
        self.precision_menu.setCurrentText(precision)
        self.precision_menu.activated.connect(self._on_placement)
        self.resolved_label = QLabel("", objectName="resolvedLabel")
        self.resolved_label.setToolTip("What the target actually runs on")
        self.addWidget(QLabel(" Target "))
        self.addWidget(self.target_menu)
        self.addWidget(QLabel("  Draft "))
        self.addWidget(self.draft_menu)
        self.addSeparator()
        self.addWidget(self.device_menu)
        self.addWidget(self.precision_menu)
        self.addWidget(self.resolved_label)

    def _combo(self, name: str, min_chars: int, tooltip: str) -> QComboBox:
        combo = QComboBox(objectName=name)
        if min_chars:
            combo.setMinimumContentsLength(min_chars)
        combo.setToolTip(tooltip)
        return combo

    def add_toggles(self, *actions: QAction) -> None:
        self.addSeparator()
        for action in actions:
            self.addAction(action)

    def set_menus_enabled(self, enabled: bool) -> None:
        for widget in (self.target_menu, self.draft_menu, self.device_menu, self.precision_menu):
            widget.setEnabled(enabled)

    def set_resolved(self, description: str, fidelity: str = "") -> None:
        """What the target runs on, and how its weights relate to the file's (the tooltip says more)."""
        self.resolved_label.setText(f"{description} · {fidelity}" if fidelity else description)
        self.resolved_label.setToolTip(
            "What the target actually runs on, and its weights against the source's"
            + (f": {fidelity}" if fidelity else "")
            + ". `specdec eval` measures perplexity and KL divergence against the source."
        )

    # -- filling the menus --------------------------------------------------------------------
    def fill_target_menu(self, current: str, recent: Sequence[str]) -> None:
        """Catalog targets, then the current and recent local refs, then the Open items."""
        self._target = current
        menu = self.target_menu
        menu.blockSignals(True)
        menu.clear()
        seen: set[str] = set()
        for entry in catalog_info.entries():
            if "target" in entry.roles:
                self._add_item(menu, entry.name, entry.name, catalog_info.describe(entry.name))
                seen.add(entry.name)
        for ref in [current, *recent]:
            if ref and ref not in seen:
                self._add_item(menu, short_ref(ref), ref, ref)
                seen.add(ref)
        self._add_open_items(menu)
        menu.addItem(qta.icon("mdi6.server-network"), "Server…", SERVER)
        menu.addItem(qta.icon("mdi6.server-plus"), "Start llama.cpp's server…", LOCAL_SERVER)
        menu.setItemData(
            menu.count() - 1,
            "Serve this .gguf target and its .gguf draft with llama.cpp's server on 127.0.0.1",
            TOOLTIP,
        )
        menu.setCurrentIndex(max(0, menu.findData(current)))
        menu.blockSignals(False)

    def fill_draft_menu(
        self, current: str, candidates: Sequence[str], verdicts: Mapping[str, Compatibility]
    ) -> None:
        """Compatible drafts first, then n-gram and None, then unchecked, then incompatible (disabled)."""
        self._draft = current
        menu = self.draft_menu
        menu.blockSignals(True)
        menu.clear()
        known = {ref: verdicts.get(ref) for ref in candidates}
        compatible = [r for r, v in known.items() if v is not None and v.compatible]
        unchecked = [r for r, v in known.items() if v is None]
        incompatible = [(r, v) for r, v in known.items() if v is not None and not v.compatible]
        for ref in compatible:
            self._add_item(menu, short_ref(ref), ref, known[ref].reason)  # type: ignore[union-attr]
        self._add_item(
            menu, DRAFT_LABELS["ngram"], "ngram", "Prompt lookup: drafts by copying from the text so far"
        )
        self._add_item(menu, DRAFT_LABELS["none"], "none", "No speculation: the target alone")
        for ref in unchecked:
            self._add_item(
                menu, short_ref(ref), ref, "not checked yet: decided from its tokenizer when it loads"
            )
        for ref, verdict in incompatible:
            self._add_item(menu, short_ref(ref), ref, f"Incompatible with the target: {verdict.reason}")
            menu.model().item(menu.count() - 1).setEnabled(False)
        self._add_open_items(menu)
        menu.setCurrentIndex(max(0, menu.findData(current)))
        menu.blockSignals(False)

    @staticmethod
    def _add_item(menu: QComboBox, label: str, data: str, tooltip: str) -> None:
        menu.addItem(label, data)
        menu.setItemData(menu.count() - 1, tooltip, TOOLTIP)

    @staticmethod
    def _add_open_items(menu: QComboBox) -> None:
        menu.insertSeparator(menu.count())
        for icon, label, data in OPEN_ITEMS:
            menu.addItem(qta.icon(icon), label, data)

    def draft_menu_entries(self) -> list[tuple[str, str, bool, str]]:
        """(label, ref, enabled, tooltip) of every draft menu item, for tests and checks."""
        menu = self.draft_menu
        out = []
        for i in range(menu.count()):
            ref = menu.itemData(i)
            if ref is None:
                continue  # a separator
            tooltip = menu.itemData(i, TOOLTIP) or ""
            out.append((menu.itemText(i), str(ref), menu.model().item(i).isEnabled(), str(tooltip)))
        return out

    # -- what the user chose ------------------------------------------------------------------
    def _on_target_activated(self, index: int) -> None:
        ref = str(self.target_menu.itemData(index))
        if ref == LOCAL_SERVER:
            self.target_menu.setCurrentIndex(max(0, self.target_menu.findData(self._target)))
            self.localServerRequested.emit()
            return
        if ref in (OPEN_FOLDER, OPEN_GGUF, HUB_ID, SERVER):
            ref = choose_model_ref(self, ref)
            if not ref:
                self.target_menu.setCurrentIndex(max(0, self.target_menu.findData(self._target)))
                return
        self.targetChosen.emit(ref)

    def _on_draft_activated(self, index: int) -> None:
        spec = str(self.draft_menu.itemData(index))
        from_dialog = spec in (OPEN_FOLDER, OPEN_GGUF, HUB_ID)
        if from_dialog:
            spec = choose_model_ref(self, spec)
            if not spec:
                self.draft_menu.setCurrentIndex(max(0, self.draft_menu.findData(self._draft)))
                return
        self.draftChosen.emit(spec, from_dialog)

    def _on_placement(self) -> None:
        self.placementChosen.emit(self.device_menu.currentText(), self.precision_menu.currentText())
