"""The app's settings: one typed wrapper over QSettings, every key a constant here.

Widgets never touch QSettings or key strings; they read and write the attributes
of `AppSettings`, each declared once as a `Setting` with its key, type and default.
When `SPECDEC_DATA_DIR` is set (tests, portable installs) the settings live in an
INI file there instead of the platform's native store, so a test never sees or
changes the user's real settings.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Generic, TypeVar, overload

from PySide6.QtCore import QByteArray, QSettings

from .conversations import DATA_DIR_ENV, data_dir
from .options import THEMES

KEY_TARGET = "models/target"
KEY_DRAFT = "models/draft"
KEY_RECENT_MODELS = "models/recent"
KEY_PRECISION = "models/precision"
KEY_DEVICE = "models/device"
KEY_LLAMA_SERVER = "models/llamaServer"  # llama.cpp's server binary ("" = $SPECDEC_LLAMA_SERVER, PATH)
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

T = TypeVar("T")


# -- reading back: QSettings returns strings from INI files, so convert explicitly ------------
def _as_str(value: object, default: str) -> str:
    return default if value is None else str(value)


def _as_int(value: object, default: int) -> int:
    try:
        return int(value)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        return default


def _as_float(value: object, default: float) -> float:
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return default


def _as_bool(value: object, default: bool) -> bool:
    if isinstance(value, str):
        return value.lower() in ("true", "1", "yes")
    return default if value is None else bool(value)


def _as_bytes(value: object, default: QByteArray) -> QByteArray:
    return value if isinstance(value, QByteArray) else QByteArray(default)


def _as_list(value: object, default: list[str]) -> list[str]:
    if isinstance(value, str):  # INI files store a one-item list as a plain string
        return [value] if value else []
    return [str(v) for v in value] if isinstance(value, list | tuple) else list(default)


class Setting(Generic[T]):
    """One persisted value: `key` in QSettings, read back as T through `convert`."""

    def __init__(
        self,
        key: str,
        default: T,
        convert: Callable[[object, T], T],
        allowed: tuple[T, ...] | None = None,
    ) -> None:
        self.key = key
        self.default = default
        self._convert = convert
        self._allowed = allowed  # values outside it read as the default

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, owner: type) -> Setting[T]: ...
    @overload
    def __get__(self, obj: AppSettings, owner: type) -> T: ...
    def __get__(self, obj: AppSettings | None, owner: type) -> Setting[T] | T:
        if obj is None:
            return self
        value = self._convert(obj.qsettings.value(self.key, self.default), self.default)
        if self._allowed is not None and value not in self._allowed:
            return self.default
        return value

    def __set__(self, obj: AppSettings, value: T) -> None:
        obj.qsettings.setValue(self.key, value)


class AppSettings:
    """Typed access to the persisted settings."""

    # models
    target = Setting(KEY_TARGET, "", _as_str)
    draft = Setting(KEY_DRAFT, "", _as_str)
    recent_models = Setting(KEY_RECENT_MODELS, [], _as_list)  # newest first; see remember_model
    precision = Setting(KEY_PRECISION, "auto", _as_str)
    device = Setting(KEY_DEVICE, "auto", _as_str)
    llama_server = Setting(KEY_LLAMA_SERVER, "", _as_str)
    # ui
    theme = Setting(KEY_THEME, "system", _as_str, allowed=tuple(THEMES))
    geometry = Setting(KEY_GEOMETRY, QByteArray(), _as_bytes)
    window_state = Setting(KEY_WINDOW_STATE, QByteArray(), _as_bytes)
    provenance = Setting(KEY_PROVENANCE, True, _as_bool)
    speculation = Setting(KEY_SPECULATION, True, _as_bool)
    last_conversation = Setting(KEY_LAST_CONVERSATION, "", _as_str)
    # generation
    system_prompt = Setting(KEY_SYSTEM_PROMPT, "", _as_str)
    max_new_tokens = Setting(KEY_MAX_NEW_TOKENS, 512, _as_int)
    temperature = Setting(KEY_TEMPERATURE, 0.0, _as_float)
    top_p = Setting(KEY_TOP_P, 1.0, _as_float)
    top_k = Setting(KEY_TOP_K, 0, _as_int)
    seed = Setting(KEY_SEED, -1, _as_int)
    draft_length = Setting(KEY_DRAFT_LENGTH, 0, _as_int)

    def __init__(self, settings: QSettings | None = None) -> None:
        if settings is None:
            if os.environ.get(DATA_DIR_ENV):
                path = data_dir() / "settings.ini"
                settings = QSettings(str(path), QSettings.Format.IniFormat)
            else:
                settings = QSettings("specdec", "specdec")
        self.qsettings = settings

    def sync(self) -> None:
        self.qsettings.sync()

    def remember_model(self, ref: str) -> None:
        """Put a local folder/GGUF/hub id at the top of the recent list (the menus show it)."""
        if ref in ("ngram", "none") or not ref:
            return
        self.recent_models = [ref, *(m for m in self.recent_models if m != ref)][:MAX_RECENT_MODELS]

    @classmethod
    def declared(cls) -> dict[str, Setting[Any]]:
        """Every setting by attribute name (for an About box, a reset, tests)."""
        return {name: value for name, value in vars(cls).items() if isinstance(value, Setting)}


def settings_path_hint() -> Path | None:
    """Where the INI file lives when the data dir is overridden (for the About box)."""
    return data_dir() / "settings.ini" if os.environ.get(DATA_DIR_ENV) else None
