"""Refuse, at import and in one line, a transformers older than the first release that works.

Our forward passes hand the KV cache over as `cache=`; transformers names that keyword
so from 5.24.0 on (5.0-5.23 call it `past_key_values` and swallow `cache=` in
**kwargs: the cache stays empty and `--draft none` prints garbage with exit code 0 —
checked in each release's modeling_qwen2.py). Read from the installed metadata, so the
check costs no import of transformers itself.
"""

from __future__ import annotations

import re
from importlib import metadata

TRANSFORMERS_MIN = (5, 24, 0)
TRANSFORMERS_BELOW = (6, 0, 0)


def check_requirements() -> None:
    try:
        found = metadata.version("transformers")
    except metadata.PackageNotFoundError:
        return  # reported by the import that needs it, with its own message
    version = _release(found)
    if version is not None and not TRANSFORMERS_MIN <= version < TRANSFORMERS_BELOW:
        raise ImportError(
            f"specdec needs transformers>={_show(TRANSFORMERS_MIN)},<{_show(TRANSFORMERS_BELOW)} "
            f"but {found} is installed: pip install 'transformers>={_show(TRANSFORMERS_MIN)},"
            f"<{_show(TRANSFORMERS_BELOW)}'"
        )


def _release(version: str) -> tuple[int, int, int] | None:
    """(major, minor, patch) of a version string ("5.1.0rc1" -> (5, 1, 0)); None if unreadable."""
    match = re.match(r"(\d+)(?:\.(\d+))?(?:\.(\d+))?", version)
    if match is None:
        return None
    major, minor, patch = (int(g or 0) for g in match.groups())
    return major, minor, patch


def _show(version: tuple[int, int, int]) -> str:
    return ".".join(str(n) for n in version)
