"""What a program that runs models does first, before anything imports torch.

Two things cannot wait until a model loads: libgomp reads its spin setting once, when
torch loads it (kernels/cpu/openmp.py), and a transformers release we cannot drive must be
refused before its first forward (models/requirements.py). Importing `specdec_core`
does neither, so a library user's process is left as it was; the `specdec` command,
the app and the bundle call `prepare_process()` at start.
"""

from __future__ import annotations

from .kernels.cpu import openmp
from .models.requirements import check_requirements


def prepare_process() -> None:
    """Refuse an unusable transformers in one line, and set libgomp's spin unless the user chose one."""
    check_requirements()
    openmp.apply_defaults()
