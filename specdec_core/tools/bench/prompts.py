"""The bench's prompts: a JSONL file (or the shipped suite), one conversation per line."""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from ...errors import SpecdecError
from ...models.chat import Message, encode_chat

DEFAULT_PROMPTS = "prompts.jsonl"


@dataclass(frozen=True)
class BenchPrompt:
    """One line of a prompts file: the user message, optional system prompt and earlier turns."""

    id: str
    category: str
    prompt: str
    system: str | None = None
    history: tuple[Message, ...] = ()

    @property
    def messages(self) -> list[Message]:
        return [*self.history, Message("user", self.prompt)]


def load_prompts(path: Path | None = None) -> list[BenchPrompt]:
    """Prompts from a JSONL file, or the default suite shipped with specdec."""
    if path is None:
        text = resources.files("specdec_resources").joinpath(DEFAULT_PROMPTS).read_text(encoding="utf-8")
        source = f"the default suite ({DEFAULT_PROMPTS})"
    else:
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise SpecdecError(f"cannot read prompts file {path}: {exc.strerror}") from exc
        source = str(path)
    prompts = [_parse_prompt(line, source, n) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    if not prompts:
        raise SpecdecError(f"{source} holds no prompts")
    ids = [p.id for p in prompts]
    if len(set(ids)) != len(ids):
        raise SpecdecError(f"{source}: prompt ids must be unique")
    return prompts


def _parse_prompt(line: str, source: str, n: int) -> BenchPrompt:
    try:
        obj = json.loads(line)
        history = tuple(Message(str(m["role"]), str(m["content"])) for m in obj.get("history", ()))
        return BenchPrompt(
            id=str(obj["id"]),
            category=str(obj["category"]),
            prompt=str(obj["prompt"]),
            system=obj.get("system"),
            history=history,
        )
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
        raise SpecdecError(
            f"{source} line {n}: expected a JSON object with id, category and prompt ({exc})"
        ) from exc


def encode_prompt(tokenizer: Any, prompt: BenchPrompt) -> list[int]:
    """The token ids every method starts from: the chat template applied once, here."""
    return encode_chat(tokenizer, prompt.messages, prompt.system)
