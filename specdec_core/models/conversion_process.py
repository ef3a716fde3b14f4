"""A GGUF conversion run in a child process, so that cancel means cancel.

transformers de-quantizes a GGUF and `save_pretrained` writes gigabytes in calls that
cannot be interrupted; converting the 1.5B default target takes minutes. Run in a
child, a cancel (closing the app, Ctrl-C, the Cancel button) stops it within a fraction
of a second — the child is terminated — and the caller discards its half-written
folder, so the next attempt restarts cleanly. The child also reports progress per
tensor, which transformers' in-process loader cannot give us.

Protocol: `python -m specdec_core.models.conversion_process GGUF OUT_DIR`, lines on stdout:

    specdec-convert: progress DONE TOTAL     one per de-quantized tensor
    specdec-convert: saving                  writing the folder
    specdec-convert: error ONE LINE          a failure the user can act on; exit code 2

Any other failure is a bug: a traceback on stderr and exit code 1, reported to the user
as an `InternalError` (exit code 1 in the CLI). A child killed by a signal (the kernel's
OOM killer) is reported as such. The child exits as soon as its stdin closes (the
parent died, even by SIGKILL), so no orphan keeps writing into the cache.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path

from ..errors import InternalError, ModelLoadError
from ..progress import Progress, ProgressCallback
from .fetch import run_streaming

PREFIX = "specdec-convert: "
USER_ERROR = 2


def convert_in_child(
    gguf_path: Path,
    out_dir: Path,
    *,
    label: str,
    progress: ProgressCallback | None = None,
    cancel: threading.Event | None = None,
) -> None:
    """Convert `gguf_path` into the empty folder `out_dir` in a child process.

    Raises `Cancelled` (the child is stopped first) or `ModelLoadError` with one line.
    """
    report = progress or (lambda _p: None)
    report(Progress(f"Converting {label} (first use only)", 0, 0))
    stage = f"Converting {label} (first use only)"

    def on_line(line: str) -> None:
        words = line.removeprefix(PREFIX).split()
        if not line.startswith(PREFIX) or not words:
            return
        if words[0] == "progress" and len(words) == 3:
            report(Progress(stage, int(words[1]), int(words[2]), unit="tensors"))
        elif words[0] == "saving":
            report(Progress(f"Saving the converted {label}", 0, 0))

    returncode, lines = run_streaming(
        child_command(gguf_path, out_dir), cancel, on_line=on_line, keep_stdin_open=True
    )
    if returncode == 0:
        return
    errors = [line.removeprefix(PREFIX + "error ") for line in lines if line.startswith(PREFIX + "error ")]
    if errors:
        raise ModelLoadError(errors[-1])
    if returncode < 0:  # killed by a signal: SIGKILL from the kernel's OOM killer, most often
        name = signal.Signals(-returncode).name
        raise ModelLoadError(
            f"the conversion of {gguf_path.name} was killed by {name} (out of memory?): it holds every "
            "weight in fp32 at once; close other programs and run again"
        )
    last = next((line for line in reversed(lines) if line.strip()), "no output")
    raise InternalError(
        f"converting {gguf_path.name} failed unexpectedly (exit code {returncode}): {last.strip()}; please report this"
    )


def child_command(gguf_path: Path, out_dir: Path) -> list[str]:
    return [sys.executable, "-m", "specdec_core.models.conversion_process", str(gguf_path), str(out_dir)]


# --- the child -------------------------------------------------------------------------


def _exit_when_parent_dies() -> None:
    def watch() -> None:
        sys.stdin.read()  # returns at EOF: the parent closed the pipe or died
        os._exit(3)

    threading.Thread(target=watch, daemon=True).start()


def _report_tensors() -> None:
    """Count transformers' de-quantized tensors by wrapping the loop's tqdm.

    If a transformers release moves that loop, only the progress numbers are lost.
    """
    try:
        from transformers import modeling_gguf_pytorch_utils as loader
    except ImportError:
        return
    base = getattr(loader, "tqdm", None)
    if base is None:
        return

    def counting(iterable, *args, **kwargs):
        items = list(iterable)
        for index, item in enumerate(items, start=1):
            yield item
            print(f"{PREFIX}progress {index} {len(items)}", flush=True)

    loader.tqdm = counting


def main(argv: list[str]) -> int:
    from ..disk_cache import disk_full_error, is_disk_full
    from .gguf_to_hf import convert_with_transformers

    _report_tensors()
    gguf_path, out_dir = Path(argv[0]), Path(argv[1])
    try:
        convert_with_transformers(gguf_path, out_dir, on_saving=lambda: print(f"{PREFIX}saving", flush=True))
    except ModelLoadError as error:
        print(f"{PREFIX}error {error}", flush=True)
        return USER_ERROR
    except Exception as error:
        # safetensors reports a full disk as SafetensorError("... No space left on device ...").
        if is_disk_full(error) or "No space left on device" in str(error):
            line = disk_full_error(out_dir.parent, None, f"nothing of {gguf_path.name} was converted")
            print(f"{PREFIX}error {line}", flush=True)
            return USER_ERROR
        raise
    return 0


if __name__ == "__main__":
    _exit_when_parent_dies()
    sys.exit(main(sys.argv[1:]))
