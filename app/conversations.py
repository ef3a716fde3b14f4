"""Conversations on disk: one JSON file per chat in the user data dir, written atomically.

A crash or kill must lose at most the tokens being generated, so the window saves
after every message (the user's, then the answer) and every write goes to a
temporary file that `os.replace` swaps in: a reader sees the old file or the new
one, never half of one. `SPECDEC_DATA_DIR` moves everything (tests use tmp dirs).

The folder is a boundary. Conversation files get shared and edited by hand, so
nothing read from one is trusted to name a path: a conversation's id *is* its file
name (checked against `ID_PATTERN`, which has no separators or dots), the `id`
inside the JSON is ignored, and every read, write and delete stays inside
`ConversationStore.root`. A file that cannot be read or has mistyped fields is
reported as `Unreadable` with the reason; it never raises anything but
`ConversationError` (a `ValueError`), so one bad file cannot stop the app.
"""

from __future__ import annotations

import json
import math
import os
import re
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import platformdirs

DATA_DIR_ENV = "SPECDEC_DATA_DIR"
FORMAT_VERSION = 1
ID_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,64}")
TEMP_PREFIX = ".tmp-"
STALE_TEMP_AGE_S = 3600.0  # a save takes milliseconds: an hour-old temp file is a killed save's

T = TypeVar("T")


class ConversationError(ValueError):
    """A conversation cannot be read, written or named as asked; `str()` is one line."""


def data_dir() -> Path:
    """Where the app keeps conversations and (in tests) its settings file."""
    override = os.environ.get(DATA_DIR_ENV)
    return Path(override) if override else Path(platformdirs.user_data_dir("specdec", appauthor=False))


def valid_id(conversation_id: object) -> bool:
    return isinstance(conversation_id, str) and ID_PATTERN.fullmatch(conversation_id) is not None


# -- reading JSON written by anyone: every field checked, one reason on failure ----------------
_MISSING = object()


def _field(data: dict[str, Any], key: str, kind: type | tuple[type, ...], default: Any, where: str) -> Any:
    """`data[key]` if it has the expected type (`default` when absent; `_MISSING`: required)."""
    value = data.get(key, default)
    if value is _MISSING:
        raise ConversationError(f"{where}{key} is missing")
    is_bool_for_number = isinstance(value, bool) and kind is not bool
    if not isinstance(value, kind) or is_bool_for_number:
        raise ConversationError(f"{where}{key} is {type(value).__name__}, not {_kind_name(kind)}")
    return value


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    names = {str: "text", list: "a list", dict: "an object", bool: "true/false", int: "a number",
             float: "a number", type(None): "null"}
    return " or ".join(dict.fromkeys(names.get(k, k.__name__) for k in kinds))


def _probability(value: Any, where: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConversationError(f"{where} is not a probability")
    return float(value)


def _items(values: list[Any], parse: Callable[[Any, str], T], where: str) -> list[T]:
    return [parse(value, f"{where}[{i}]") for i, value in enumerate(values)]


@dataclass
class StoredToken:
    """One committed token of an answer, enough to redraw its tint and tooltip."""

    text: str
    source: str  # accepted | corrected | bonus | target
    step: int
    target_prob: float | None = None
    draft_prob: float | None = None

    def to_json(self) -> list[Any]:
        # A compact row: answers hold hundreds of tokens.
        return [self.text, self.source, self.step, self.target_prob, self.draft_prob]

    @classmethod
    def from_json(cls, row: Any, where: str = "token") -> StoredToken:
        if not isinstance(row, list) or len(row) != 5:
            raise ConversationError(f"{where} is not a [text, source, step, p, q] row")
        text, source, step, target_prob, draft_prob = row
        if not isinstance(text, str) or not isinstance(source, str):
            raise ConversationError(f"{where} has a text or source that is not text")
        if isinstance(step, bool) or not isinstance(step, int):
            raise ConversationError(f"{where} has a step that is not a whole number")
        return cls(
            text, source, step, _probability(target_prob, f"{where}[3]"), _probability(draft_prob, f"{where}[4]")
        )


@dataclass
class StoredMessage:
    role: str  # "user" | "assistant"
    content: str
    tokens: list[StoredToken] = field(default_factory=list)  # assistant answers only
    footer: str = ""  # "Draft: … · accepted A/P (R%) · S× faster" (side_panel.answer_footer)
    stopped: bool = False  # the user stopped it: the content is a prefix of the answer

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tokens:
            out["tokens"] = [t.to_json() for t in self.tokens]
        if self.footer:
            out["footer"] = self.footer
        if self.stopped:
            out["stopped"] = True
        return out

    @classmethod
    def from_json(cls, data: Any, where: str = "message") -> StoredMessage:
        if not isinstance(data, dict):
            raise ConversationError(f"{where} is {type(data).__name__}, not an object")
        role = _field(data, "role", str, _MISSING, f"{where}.")
        if role not in ("user", "assistant"):
            raise ConversationError(f"{where}.role is {role!r}, not 'user' or 'assistant'")
        tokens = _field(data, "tokens", list, [], f"{where}.")
        return cls(
            role=role,
            content=_field(data, "content", str, _MISSING, f"{where}."),
            tokens=_items(tokens, StoredToken.from_json, f"{where}.tokens"),
            footer=_field(data, "footer", str, "", f"{where}."),
            stopped=_field(data, "stopped", bool, False, f"{where}."),
        )


@dataclass
class Conversation:
    id: str
    title: str = "New chat"
    system_prompt: str = ""
    created: float = field(default_factory=time.time)
    updated: float = field(default_factory=time.time)
    messages: list[StoredMessage] = field(default_factory=list)

    @classmethod
    def new(cls, system_prompt: str = "") -> Conversation:
        return cls(id=uuid.uuid4().hex[:12], system_prompt=system_prompt)

    def to_json(self) -> dict[str, Any]:
        # Field by field: dataclasses.asdict would deep-copy every token only to be replaced.
        return {
            "id": self.id,
            "title": self.title,
            "system_prompt": self.system_prompt,
            "created": self.created,
            "updated": self.updated,
            "messages": [m.to_json() for m in self.messages],
            "version": FORMAT_VERSION,
        }

    def file_text(self) -> str:
        """The file's JSON, one message a line. Each line is one call of json's C encoder
        (an indented dump runs its pure-Python one), so saving a long conversation in the
        background never holds the GIL for long while the UI thread draws."""
        data = self.to_json()
        messages = ",\n".join(json.dumps(m, ensure_ascii=False) for m in data.pop("messages"))
        fields = [f" {json.dumps(k)}: {json.dumps(v, ensure_ascii=False)}" for k, v in data.items()]
        return "{\n" + ",\n".join([*fields, f' "messages": [\n{messages}\n ]']) + "\n}\n"

    @classmethod
    def from_json(cls, data: Any, conversation_id: str) -> Conversation:
        """The conversation stored under `conversation_id` (the JSON's own `id` is not trusted)."""
        if not isinstance(data, dict):
            raise ConversationError(f"the file holds {type(data).__name__}, not a conversation object")
        number = (int, float)
        return cls(
            id=conversation_id,
            title=_field(data, "title", str, "New chat", ""),
            system_prompt=_field(data, "system_prompt", str, "", ""),
            created=float(_field(data, "created", number, 0.0, "")),
            updated=float(_field(data, "updated", number, 0.0, "")),
            messages=_items(_field(data, "messages", list, _MISSING, ""), StoredMessage.from_json, "messages"),
        )


@dataclass(frozen=True)
class Unreadable:
    """A file in the conversations folder that could not be read, and why (for the sidebar)."""

    name: str  # the file name
    reason: str
    conversation_id: str | None  # None when the file name is not a valid id (Delete cannot name it)


@dataclass(frozen=True)
class Listing:
    conversations: tuple[Conversation, ...]  # most recently updated first
    unreadable: tuple[Unreadable, ...]  # by file name


def title_from(text: str, limit: int = 48) -> str:
    """A sidebar title from the first user message: its first line, shortened on a word."""
    line = text.strip().splitlines()[0] if text.strip() else "New chat"
    if len(line) <= limit:
        return line
    return line[:limit].rsplit(" ", 1)[0].rstrip(" ,.;:") + "…"


class ConversationStore:
    """The folder of conversations: list, load, save (atomically), delete — nothing outside it."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = (root or data_dir()) / "conversations"

    def path(self, conversation_id: str) -> Path:
        """The file of a conversation; ConversationError for an id that could leave the folder."""
        if not valid_id(conversation_id):
            raise ConversationError(
                f"{conversation_id!r} is not a conversation id (1-64 letters, digits, '-' or '_')"
            )
        return self.root / f"{conversation_id}.json"

    def exists(self, conversation_id: str) -> bool:
        return valid_id(conversation_id) and self.path(conversation_id).is_file()

    def save(self, conversation: Conversation) -> None:
        """Write atomically; ConversationError (the file on disk unchanged) when the disk refuses."""
        target = self.path(conversation.id)
        conversation.updated = time.time()
        text = conversation.file_text()
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=TEMP_PREFIX, suffix=".json", dir=self.root)
        except OSError as exc:
            raise ConversationError(f"cannot save {target.name}: {exc.strerror or exc}") from exc
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                handle.write(text)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, target)
        except BaseException as exc:
            Path(tmp).unlink(missing_ok=True)
            if isinstance(exc, OSError):
                raise ConversationError(f"cannot save {target.name}: {exc.strerror or exc}") from exc
            raise

    def load(self, conversation_id: str) -> Conversation:
        """The conversation, or ConversationError naming why it cannot be read."""
        path = self.path(conversation_id)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConversationError(f"conversation {conversation_id} no longer exists") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ConversationError(f"cannot read {path.name}: {exc}") from None
        except json.JSONDecodeError as exc:
            raise ConversationError(f"{path.name} is not valid JSON ({exc.msg}, line {exc.lineno})") from None
        except RecursionError:
            raise ConversationError(f"{path.name} is nested too deeply to be a conversation") from None
        try:
            return Conversation.from_json(data, conversation_id)
        except ConversationError as exc:
            raise ConversationError(f"{path.name}: {exc}") from None

    def delete(self, conversation_id: str) -> None:
        self.path(conversation_id).unlink(missing_ok=True)

    def scan(self) -> Listing:
        """Every conversation file: the readable ones newest first, the others with a reason."""
        if not self.root.is_dir():
            return Listing((), ())
        self._remove_stale_temp_files()
        found: list[Conversation] = []
        unreadable: list[Unreadable] = []
        for file in sorted(self.root.glob("*.json")):
            if file.name.startswith("."):
                continue  # temp files of a save in progress, editors' and OS dot files
            stem = file.name[: -len(".json")]
            if not valid_id(stem):
                unreadable.append(Unreadable(file.name, "its name is not a conversation id", None))
                continue
            try:
                found.append(self.load(stem))
            except ConversationError as exc:
                unreadable.append(Unreadable(file.name, str(exc), stem))
        found.sort(key=lambda c: c.updated, reverse=True)
        return Listing(tuple(found), tuple(unreadable))

    def list(self) -> list[Conversation]:
        """All readable conversations, most recently updated first (see `scan` for the others)."""
        return list(self.scan().conversations)

    def _remove_stale_temp_files(self) -> None:
        cutoff = time.time() - STALE_TEMP_AGE_S
        for tmp in self.root.glob(f"{TEMP_PREFIX}*"):
            try:
                if tmp.is_file() and tmp.stat().st_mtime < cutoff:
                    tmp.unlink()
            except OSError:
                continue  # another instance removed it first, or it is not ours to remove
