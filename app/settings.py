"""The app's settings: one typed wrapper over QSettings, every key a constant here.

Widgets never touch QSettings or key strings; they read and write these properties.
When `SPECDEC_DATA_DIR` is set (tests, portable installs) the settings live in an
INI file there instead of the platform's native store, so a test never sees or
changes the user's real settings.
"""

from __future__ import annotations

import os
from pathlib import Path

from PySide6.QtCore import QByteArray, QSettings

from .cli import THEMES
from .conversations import DATA_DIR_ENV, data_dir

KEY_TARGET = "models/target"
KEY_DRAFT = "models/draft"
KEY_RECENT_MODELS = "models/recent"
KEY_PRECISION = "models/precision"
KEY_DEVICE = "models/device"
KEY_THEME = "ui/theme"
KEY_GEOMETRY = "ui/geometry"
KEY_WINDOW_STATE = "ui/windowState"
KEY_PROVENANCE = "ui/provenance"
KEY_SPECULATION = "ui/speculation"
KEY_LAST_CONVERSATION = "ui/lastConversation"
KEY_SYSTEM_PROMPT = "generation/systemPrompt"
KEY_MAX_NEW_TOKENS = "generation/maxNewTokens"
KEY_TEMPERATURE = "generation/temperature"
KEY_TOP_P = "generation/topP"
KEY_TOP_K = "generation/topK"
KEY_SEED = "generation/seed"  # -1 = random
KEY_DRAFT_LENGTH = "generation/draftLength"  # 0 = adaptive

MAX_RECENT_MODELS = 12


class AppSettings:
    """Typed access to the persisted settings."""

    def __init__(self, settings: QSettings | None = None) -> None:
        if settings is None:
            if os.environ.get(DATA_DIR_ENV):
                path = data_dir() / "settings.ini"
                settings = QSettings(str(path), QSettings.Format.IniFormat)
            else:
                settings = QSettings("specdec", "specdec")
        self._s = settings

    def sync(self) -> None:
        self._s.sync()

    # -- helpers: QSettings returns strings from INI files, so convert explicitly ----
    def _str(self, key: str, default: str) -> str:
        value = self._s.value(key, default)
        return default if value is None else str(value)

    def _int(self, key: str, default: int) -> int:
        try:
            return int(self._s.value(key, default))
        except (TypeError, ValueError):
            return default

    def _float(self, key: str, default: float) -> float:
        try:
            return float(self._s.value(key, default))
        except (TypeError, ValueError):
            return default

    def _bool(self, key: str, default: bool) -> bool:
        value = self._s.value(key, default)
        if isinstance(value, str):
            return value.lower() in ("true", "1", "yes")
        return bool(value)

    # -- models ------------------------------------------------------------------------
    @property
    def target(self) -> str:
        return self._str(KEY_TARGET, "")

    @target.setter
    def target(self, ref: str) -> None:
        self._s.setValue(KEY_TARGET, ref)

    @property
    def draft(self) -> str:
        return self._str(KEY_DRAFT, "")

    @draft.setter
    def draft(self, spec: str) -> None:
        self._s.setValue(KEY_DRAFT, spec)

    @property
    def recent_models(self) -> list[str]:
        value = self._s.value(KEY_RECENT_MODELS, [])
        if isinstance(value, str):
            value = [value] if value else []
        return [str(v) for v in value or []]

    def remember_model(self, ref: str) -> None:
        """Put a local folder/GGUF/hub id at the top of the recent list (the menus show it)."""
        if ref in ("ngram", "none") or not ref:
            return
        models = [ref, *(m for m in self.recent_models if m != ref)][:MAX_RECENT_MODELS]
        self._s.setValue(KEY_RECENT_MODELS, models)

    @property
    def precision(self) -> str:
        return self._str(KEY_PRECISION, "auto")

    @precision.setter
    def precision(self, value: str) -> None:
        self._s.setValue(KEY_PRECISION, value)

    @property
    def device(self) -> str:
        return self._str(KEY_DEVICE, "auto")

    @device.setter
    def device(self, value: str) -> None:
        self._s.setValue(KEY_DEVICE, value)

    # -- ui --------------------------------------------------------------------------
    @property
    def theme(self) -> str:
        value = self._str(KEY_THEME, "system")
        return value if value in THEMES else "system"

    @theme.setter
    def theme(self, value: str) -> None:
        self._s.setValue(KEY_THEME, value)

    @property
    def geometry(self) -> QByteArray:
        value = self._s.value(KEY_GEOMETRY, QByteArray())
        return value if isinstance(value, QByteArray) else QByteArray()

    @geometry.setter
    def geometry(self, value: QByteArray) -> None:
        self._s.setValue(KEY_GEOMETRY, value)

    @property
    def window_state(self) -> QByteArray:
        value = self._s.value(KEY_WINDOW_STATE, QByteArray())
        return value if isinstance(value, QByteArray) else QByteArray()

    @window_state.setter
    def window_state(self, value: QByteArray) -> None:
        self._s.setValue(KEY_WINDOW_STATE, value)

    @property
    def provenance(self) -> bool:
        return self._bool(KEY_PROVENANCE, True)

    @provenance.setter
    def provenance(self, on: bool) -> None:
        self._s.setValue(KEY_PROVENANCE, on)

    @property
    def speculation(self) -> bool:
        return self._bool(KEY_SPECULATION, True)

    @speculation.setter
    def speculation(self, on: bool) -> None:
        self._s.setValue(KEY_SPECULATION, on)

    @property
    def last_conversation(self) -> str:
        return self._str(KEY_LAST_CONVERSATION, "")

    @last_conversation.setter
    def last_conversation(self, conversation_id: str) -> None:
        self._s.setValue(KEY_LAST_CONVERSATION, conversation_id)

    # -- generation ------------------------------------------------------------------
    @property
    def system_prompt(self) -> str:
        return self._str(KEY_SYSTEM_PROMPT, "")

    @system_prompt.setter
    def system_prompt(self, text: str) -> None:
        self._s.setValue(KEY_SYSTEM_PROMPT, text)

    @property
    def max_new_tokens(self) -> int:
        return self._int(KEY_MAX_NEW_TOKENS, 512)

    @max_new_tokens.setter
    def max_new_tokens(self, n: int) -> None:
        self._s.setValue(KEY_MAX_NEW_TOKENS, n)

    @property
    def temperature(self) -> float:
        return self._float(KEY_TEMPERATURE, 0.0)

    @temperature.setter
    def temperature(self, t: float) -> None:
        self._s.setValue(KEY_TEMPERATURE, t)

    @property
    def top_p(self) -> float:
        return self._float(KEY_TOP_P, 1.0)

    @top_p.setter
    def top_p(self, p: float) -> None:
        self._s.setValue(KEY_TOP_P, p)

    @property
    def top_k(self) -> int:
        return self._int(KEY_TOP_K, 0)

    @top_k.setter
    def top_k(self, k: int) -> None:
        self._s.setValue(KEY_TOP_K, k)

    @property
    def seed(self) -> int:
        return self._int(KEY_SEED, -1)

    @seed.setter
    def seed(self, seed: int) -> None:
        self._s.setValue(KEY_SEED, seed)

    @property
    def draft_length(self) -> int:
        return self._int(KEY_DRAFT_LENGTH, 0)

    @draft_length.setter
    def draft_length(self, k: int) -> None:
        self._s.setValue(KEY_DRAFT_LENGTH, k)


def settings_path_hint() -> Path | None:
    """Where the INI file lives when the data dir is overridden (for the About box)."""
    return data_dir() / "settings.ini" if os.environ.get(DATA_DIR_ENV) else None
