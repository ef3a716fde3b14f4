"""Errors a user can act on: each carries one line that says what went wrong.

The CLI and the app print `str(error)` and nothing else (no traceback), so the
message must name the thing (path, model, package) and, where there is one, the fix.
"""

from __future__ import annotations


class SpecdecError(Exception):
    """Base of every error that reaches the user as a one-line message."""


class ModelLoadError(SpecdecError):
    """A model reference could not be turned into a loaded model."""


class IncompatibleDraftError(SpecdecError):
    """The draft's token<->id mapping disagrees with the target's."""


class FetchError(SpecdecError):
    """A download, verification or conversion failed."""


class Cancelled(SpecdecError):
    """The user cancelled a long operation (fetch, conversion, load)."""
