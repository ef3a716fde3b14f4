"""Chat prompts: messages -> token ids through the model's own chat template,
and the token ids that end an assistant turn.

A chat template is code that came with the model (Jinja, run in transformers'
sandbox). It is rendered with a time limit — a template looping `range(99999)`
inside another would otherwise hang the answer for hours — and every way it can
fail becomes one `ChatTemplateError` line naming the model's template.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from types import FrameType
from typing import Any

from ..errors import ChatTemplateError, InvalidInput

# Real templates render in well under a millisecond per message; a second is a loop.
TEMPLATE_TIME_LIMIT_S = 1.0


# End-of-turn tokens of the chat templates people use; a model's stop tokens are its
# EOS plus whichever of these its vocabulary holds.
END_OF_TURN_TOKENS = (
    "<|im_end|>",  # ChatML: Qwen, SmolLM, many fine-tunes
    "<|endoftext|>",
    "<|eot_id|>",  # Llama 3
    "<|eom_id|>",
    "<end_of_turn>",  # Gemma
    "<|end|>",  # Phi-3
)


def stop_tokens(tokenizer: Any, vocab: Mapping[str, int] | None = None) -> list[str]:
    """The tokenizer's EOS and the end-of-turn tokens it defines as added (special) tokens.

    Only added tokens count: in Qwen's byte-level vocabulary "</s>" is an ordinary
    merge (id 128247) that a model may well write in the middle of an answer.
    """
    vocab = tokenizer.get_vocab() if vocab is None else vocab
    get_added = getattr(tokenizer, "get_added_vocab", None)
    special = get_added() if callable(get_added) else vocab
    stops = [token for token in END_OF_TURN_TOKENS if token in special]
    eos = getattr(tokenizer, "eos_token", None)
    if isinstance(eos, str) and eos in vocab and eos not in stops:
        stops.insert(0, eos)
    return stops


@dataclass(frozen=True)
class Message:
    role: str  # "system" | "user" | "assistant"
    content: str


def encode_chat(
    tokenizer: Any,
    messages: Sequence[Message],
    system: str | None = None,
    *,
    time_limit_s: float = TEMPLATE_TIME_LIMIT_S,
) -> list[int]:
    """Token ids of the conversation, ending where the assistant's answer starts."""
    convo = [{"role": m.role, "content": m.content} for m in messages]
    if system:
        convo.insert(0, {"role": "system", "content": system})
    for message in convo:
        check_text(message["content"], f"the {message['role']} message")
    if getattr(tokenizer, "chat_template", None):
        text = render_template(tokenizer, convo, time_limit_s)
        # The template wrote the special tokens itself; the tokenizer must not add more
        # (what apply_chat_template(tokenize=True) does).
        return encode_text(tokenizer, text, add_special_tokens=False)
    # No template (a base model): a plain transcript it can continue.
    text = "".join(f"{m['role'].capitalize()}: {m['content']}\n" for m in convo) + "Assistant:"
    return encode_text(tokenizer, text)


def settled_prefix(
    tokenizer: Any, messages: Sequence[Message], typing: str, system: str | None = None
) -> list[int]:
    """The tokens a prompt will start with once `typing`, a user message still being written,
    is sent after `messages`, whatever is typed after it.

    The word being typed is left out (text up to the last whitespace), then the tokens that
    change when more text follows (the template's end of turn, found by rendering `typing`
    followed by a probe), and `SETTLE_MARGIN` more: byte-pair merges may join a boundary's
    whitespace or punctuation with what comes next. A prefix that still turns out wrong
    costs only reuse: the engine keeps the part a cache shares with the final prompt."""
    head = typing.rstrip()
    head = head[: max(head.rfind(" "), head.rfind("\n"), 0)]
    now = encode_chat(tokenizer, [*messages, Message("user", head)], system)
    later = encode_chat(tokenizer, [*messages, Message("user", head + SETTLE_PROBE)], system)
    shared = next((i for i, (a, b) in enumerate(zip(now, later, strict=False)) if a != b), len(now))
    return now[: max(0, shared - SETTLE_MARGIN)]


# What settled_prefix renders after the text to see where the text's tokens end.
SETTLE_PROBE = " x"
# Tokens dropped before that end: a merge across the boundary reaches back one or two.
SETTLE_MARGIN = 2


def encode_text(tokenizer: Any, text: str, *, add_special_tokens: bool = True) -> list[int]:
    """Token ids of plain text (a `--raw` prompt, or a rendered template)."""
    check_text(text, "the prompt")
    return [int(i) for i in tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]]


def check_text(text: str, what: str) -> None:
    """Refuse text that is not valid Unicode (e.g. undecodable bytes from a terminal argument)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        # Undecodable argv bytes arrive as lone surrogates U+DC80..U+DCFF (PEP 383).
        char = text[exc.start]
        shown = f"byte 0x{ord(char) - 0xDC00:02x}" if 0xDC80 <= ord(char) <= 0xDCFF else f"U+{ord(char):04X}"
        raise InvalidInput(f"{what} is not valid UTF-8 text ({shown} at character {exc.start})") from None


def render_template(tokenizer: Any, convo: list[dict[str, str]], time_limit_s: float) -> str:
    from jinja2 import TemplateError

    try:
        with _time_limit(time_limit_s):
            text = tokenizer.apply_chat_template(convo, add_generation_prompt=True, tokenize=False)
    except _TemplateTimeout:
        raise ChatTemplateError(
            f"the model's chat template ran longer than {time_limit_s:g} s and was stopped "
            "(a loop in tokenizer_config.json's chat_template?)"
        ) from None
    except TemplateError as exc:  # SecurityError (sandbox), syntax errors, raise_exception()
        raise ChatTemplateError(
            f"the model's chat template failed: {_first_line(exc)} ({type(exc).__name__})"
        ) from exc
    except (MemoryError, RecursionError) as exc:
        raise ChatTemplateError(f"the model's chat template failed: {type(exc).__name__}") from exc
    if not isinstance(text, str):
        raise ChatTemplateError(f"the model's chat template rendered {type(text).__name__}, not text")
    return text


class _TemplateTimeout(Exception):
    pass


@contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    """Raise _TemplateTimeout inside the rendering once `seconds` have passed.

    Jinja compiles a template to Python code (file name "<template>"), so a trace
    function on this thread sees each line the template runs and can stop it there;
    no second thread or process is needed. Only template frames are traced line by
    line, which keeps the overhead to the template's own lines.
    """
    deadline = time.monotonic() + seconds
    previous = sys.gettrace()

    def on_line(frame: FrameType, event: str, arg: object) -> Any:
        if time.monotonic() > deadline:
            raise _TemplateTimeout
        return on_line

    def on_call(frame: FrameType, event: str, arg: object) -> Any:
        if time.monotonic() > deadline:
            raise _TemplateTimeout
        return on_line if frame.f_code.co_filename == "<template>" else None

    sys.settrace(on_call)
    try:
        yield
    finally:
        sys.settrace(previous)


def stop_token_ids(tokenizer: Any, model: Any = None) -> set[int]:
    """EOS and added end-of-turn tokens (`stop_tokens`), plus the generation config's EOS."""
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


def template_token_ids(tokenizer: Any) -> set[int]:
    """The ids a conversation is wrapped in whatever its text: the tokenizer's special and
    added tokens, and the ids of its chat template rendered around empty messages (role
    names, turn markers, a default system prompt). Only the special ones if it renders none."""
    ids = {int(i) for i in getattr(tokenizer, "all_special_ids", ())}
    ids.update(int(i) for i in getattr(tokenizer, "added_tokens_decoder", {}))
    if not getattr(tokenizer, "chat_template", None):
        return ids
    empty = [Message("user", ""), Message("assistant", ""), Message("user", "")]
    # A template may refuse empty turns; the conversations it renders will say more.
    with suppress(ChatTemplateError):
        ids.update(encode_chat(tokenizer, empty, time_limit_s=TEMPLATE_TIME_LIMIT_S))
    return ids


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
