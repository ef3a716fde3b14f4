"""Conversations on disk: one JSON file per chat in the user data dir, written atomically.

A crash or kill must lose at most the tokens being generated, so the window saves
after every message (the user's, then the answer) and every write goes to a
temporary file that `os.replace` swaps in: a reader sees the old file or the new
one, never half of one. `SPECDEC_DATA_DIR` moves everything (tests use tmp dirs).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import platformdirs

DATA_DIR_ENV = "SPECDEC_DATA_DIR"
FORMAT_VERSION = 1


def data_dir() -> Path:
    """Where the app keeps conversations and (in tests) its settings file."""
    override = os.environ.get(DATA_DIR_ENV)
    return Path(override) if override else Path(platformdirs.user_data_dir("specdec", appauthor=False))


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
    def from_json(cls, row: list[Any]) -> StoredToken:
        return cls(str(row[0]), str(row[1]), int(row[2]), row[3], row[4])


@dataclass
class StoredMessage:
    role: str  # "user" | "assistant"
    content: str
    tokens: list[StoredToken] = field(default_factory=list)  # assistant answers only
    footer: str = ""  # "Draft: … · accepted 143/180 (79%) · 2.1× faster"
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
    def from_json(cls, data: dict[str, Any]) -> StoredMessage:
        return cls(
            role=str(data["role"]),
            content=str(data["content"]),
            tokens=[StoredToken.from_json(r) for r in data.get("tokens", [])],
            footer=str(data.get("footer", "")),
            stopped=bool(data.get("stopped", False)),
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
        plain = asdict(self)
        plain["messages"] = [m.to_json() for m in self.messages]
        plain["version"] = FORMAT_VERSION
        return plain

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Conversation:
        return cls(
            id=str(data["id"]),
            title=str(data.get("title", "New chat")),
            system_prompt=str(data.get("system_prompt", "")),
            created=float(data.get("created", 0.0)),
            updated=float(data.get("updated", 0.0)),
            messages=[StoredMessage.from_json(m) for m in data.get("messages", [])],
        )


def title_from(text: str, limit: int = 48) -> str:
    """A sidebar title from the first user message: its first line, shortened on a word."""
    line = text.strip().splitlines()[0] if text.strip() else "New chat"
    if len(line) <= limit:
        return line
    return line[:limit].rsplit(" ", 1)[0].rstrip(" ,.;:") + "…"


class ConversationStore:
    """The folder of conversations: list, load, save (atomically), delete."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = (root or data_dir()) / "conversations"

    def path(self, conversation_id: str) -> Path:
        return self.root / f"{conversation_id}.json"

    def save(self, conversation: Conversation) -> None:
        conversation.updated = time.time()
        self.root.mkdir(parents=True, exist_ok=True)
        text = json.dumps(conversation.to_json(), ensure_ascii=False, indent=1)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=self.root)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                handle.write(text)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, self.path(conversation.id))
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def load(self, conversation_id: str) -> Conversation:
        return Conversation.from_json(json.loads(self.path(conversation_id).read_text(encoding="utf-8")))

    def delete(self, conversation_id: str) -> None:
        self.path(conversation_id).unlink(missing_ok=True)

    def list(self) -> list[Conversation]:
        """All readable conversations, most recently updated first (unreadable files are skipped)."""
        if not self.root.is_dir():
            return []
        found: list[Conversation] = []
        for file in self.root.glob("*.json"):
            try:
                found.append(Conversation.from_json(json.loads(file.read_text(encoding="utf-8"))))
            except (OSError, ValueError, KeyError, TypeError):
                continue  # a foreign or damaged file must not hide the others
        return sorted(found, key=lambda c: c.updated, reverse=True)
