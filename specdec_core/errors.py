"""Errors a user can act on: each carries one line that says what went wrong.

The CLI and the app print `str(error)` and nothing else (no traceback), so the
message must name the thing (path, model, package) and, where there is one, the fix.
`str()` of every `SpecdecError` is a single line, whatever text it was given.
`exit_code` is what the CLI returns: 2 for something the user can change (input,
model, machine), 1 for `InternalError` (a bug of ours, with the cause chained).
"""

from __future__ import annotations


class SpecdecError(Exception):
    """Base of every error that reaches the user as a one-line message."""

    exit_code = 2

    def __str__(self) -> str:
        return " ".join(super().__str__().split())


class ModelLoadError(SpecdecError):
    """A model reference could not be turned into a loaded model."""


class IncompatibleDraftError(SpecdecError):
    """The draft's token<->id mapping disagrees with the target's."""


class FetchError(SpecdecError):
    """A download, verification or conversion failed."""


class Cancelled(SpecdecError):
    """The user cancelled a long operation (fetch, conversion, load)."""


class InvalidParameter(SpecdecError):
    """A generation parameter is outside its allowed range (the message gives the range)."""


class InvalidInput(SpecdecError):
    """A prompt or message cannot be used (empty, not valid text)."""


class ChatTemplateError(SpecdecError):
    """The model's chat template failed, was blocked by the sandbox, or ran too long."""


class ContextTooLong(SpecdecError):
    """The conversation does not fit in the model's positions."""


class OutOfMemory(SpecdecError):
    """Memory ran out; the caches were reset and the session is still usable."""


class NotLoaded(SpecdecError):
    """A session call that needs a model came before `load`."""


class InternalError(SpecdecError):
    """Something failed that should not have: a bug of ours (the cause is chained)."""

    exit_code = 1


class NumericalError(SpecdecError):
    """A model produced inf/NaN logits (typically fp16 overflow); the caches were reset."""


class ServerError(SpecdecError):
    """A served engine could not be reached or used: unreachable, refused key, model, timeout, stream."""
