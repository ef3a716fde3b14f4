"""Chat prompts: messages -> token ids through the model's own chat template,
and the token ids that end an assistant turn."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .compat import stop_tokens


@dataclass(frozen=True)
class Message:
    role: str  # "system" | "user" | "assistant"
    content: str


def encode_chat(tokenizer: Any, messages: Sequence[Message], system: str | None = None) -> list[int]:
    """Token ids of the conversation, ending where the assistant's answer starts."""
    convo = [{"role": m.role, "content": m.content} for m in messages]
    if system:
        convo.insert(0, {"role": "system", "content": system})
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(
            convo, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # BatchEncoding in some versions
            ids = ids["input_ids"]
        return [int(i) for i in ids]
    # No template (a base model): a plain transcript it can continue.
    text = "".join(f"{m['role'].capitalize()}: {m['content']}\n" for m in convo) + "Assistant:"
    return [int(i) for i in tokenizer(text)["input_ids"]]


def stop_token_ids(tokenizer: Any, model: Any = None) -> set[int]:
    """EOS and added end-of-turn tokens (`compat.stop_tokens`), plus the generation config's EOS."""
    vocab = tokenizer.get_vocab()
    ids = {vocab[token] for token in stop_tokens(tokenizer, vocab)}
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    config_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(config_eos, int):
        ids.add(config_eos)
    elif config_eos:
        ids.update(int(i) for i in config_eos)
    return ids
