"""The CPU backend's preparation of a loaded model, in place: what the kernels make of a
target's and a draft's weights after transformers has read them.

A target keeps the precision the user chose, computed by our kernels so that a verify
gives bitwise the logits of plain steps (the self-check measures it at load). A draft's
numbers never reach the answer (the target verifies every token it proposes), so a draft
may round more: 4-bit steps, a head scored only where the conversation needs it, and
int8 reads of long prompts.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from ..engine.draft_bulk import speed_up_reads
from ..engine.draft_vocab import rank_head
from ..kernels.batch_invariant import make_batch_invariant
from ..kernels.cpu import int4_cpu
from ..kernels.cpu.draft_int4 import speed_up_draft
from ..kernels.cpu.fused_int8 import apply_fusion
from ..kernels.cpu.gguf_blocks import GGUFLinear
from ..kernels.cpu.huge_pages import place_in_huge_pages, return_freed_memory
from ..kernels.cpu.int4_cpu import head_to_int4
from ..kernels.cpu.layers_cpu import speed_up_layers
from ..kernels.cpu.quant_cpu import quantize_linears_int8
from ..progress import Progress, ProgressCallback


def prepare_for_cpu(model: Any, precision: str) -> None:
    """What loading makes of a model on the CPU, in place, after its weights are read."""
    if precision in ("int8", "int4"):
        if precision == "int4":
            int4_cpu.quantize_linears_int4(model)
        else:
            quantize_linears_int8(model)
        apply_fusion(model)  # q/k/v and gate/up as one linear each: bitwise the same logits
        copy_out_of_checkpoint_file(model)
        place_in_huge_pages(model.modules())  # streamed faster; before the fast layers note addresses
    # At every precision: a verify and plain decoding give bitwise-equal logits
    # (batch_invariant; measured at load by the self-check).
    make_batch_invariant(model)
    if precision in ("int8", "int4"):
        speed_up_layers(model)  # norms and rotary embedding in C: fewer calls a layer
        return_freed_memory()


def prepare_as_stored(model: Any) -> None:
    """What loading makes of a GGUF run from its blocks (gguf_native), in place. The linears
    repacked for the 4-bit kernel become its modules (the same bytes and kernel call), so they
    get what the int4 path gets: q/k/v and gate/up fused where their layouts match, 2 MB
    pages, one C call a layer. Attention is row-wise, as the block kernels are."""
    _repacked_as_int4(model)
    apply_fusion(model)
    return_freed_memory()  # the parts fusion copied: before the next copy, not after
    place_in_huge_pages(model.modules())
    make_batch_invariant(model)
    speed_up_layers(model)
    return_freed_memory()


def _repacked_as_int4(model: Any) -> None:
    """Each repacked GGUF linear replaced by int4_cpu's module over the same bytes. Its own
    function, so no reference to a replaced module outlives it: the next steps copy the
    bytes and free the old ones."""
    names = [name for name, module in model.named_modules() if isinstance(module, GGUFLinear)]
    for name in names:
        int4 = model.get_submodule(name).as_int4()
        if int4 is not None:
            model.set_submodule(name, int4)


def copy_out_of_checkpoint_file(model: Any) -> None:
    """Copy the tensors still read from the checkpoint file into the process's memory.

    from_pretrained maps the safetensors file, and a tensor it loads as is stays a view of
    that mapping. After quantization only a few remain (the norms' weights, biases, the
    embedding), yet any one of them keeps the whole file mapped, and every page that
    quantizing read stays counted in the process's resident memory: 8.2 GB for the 1.5B
    at int4 (its converted fp32 file is 6.2 GB) against 1.9 GB of weights. Copied, the
    mapping closes. Needs Linux's /proc/self/maps; elsewhere nothing moves.
    """
    files = _file_mappings()
    for tensor in [*model.parameters(), *model.buffers()]:
        address = tensor.data_ptr()
        if tensor.numel() and any(start <= address < end for start, end in files):
            tensor.data = tensor.data.clone()


def _file_mappings() -> list[tuple[int, int]]:
    """Address ranges this process has mapped from files (inode not 0)."""
    try:
        with open("/proc/self/maps", encoding="ascii", errors="replace") as maps:
            lines = maps.read().splitlines()
    except OSError:
        return []
    ranges = []
    for line in lines:
        fields = line.split()
        if len(fields) >= 6 and fields[4] != "0":
            start, end = (int(part, 16) for part in fields[0].split("-"))
            ranges.append((start, end))
    return ranges


def prepare_draft_for_cpu(
    model: Any,
    precision: str,
    first_ids: Sequence[int],
    *,
    progress: ProgressCallback | None = None,
    cancel: threading.Event | None = None,
) -> str:
    """A loaded draft made cheaper to step, in place; returns the precision it now runs.

    `first_ids` are the ids every conversation needs (stop tokens, the chat template's
    wrapping): a 4-bit head ranks them first, so a step scoring only the likely ids
    keeps them (draft_vocab.py).
    """
    if precision == "int8" and speed_up_draft(model):
        return "int8/int4"  # 4-bit draft steps: the target still verifies
    if precision != "int4":
        return precision
    # The target's head keeps 6 bits; a draft's may round more, and its rows go by rank so
    # a step can score only those the conversation needs.
    head_to_int4(model)
    if rank_head(model, list(first_ids)) is not None:
        place_in_huge_pages([model.get_output_embeddings()])
    if progress is not None:
        progress(Progress("Preparing the draft's int8 reads", 0, 0))
    if speed_up_reads(model, cancel=cancel):  # reads of many tokens in int8 (draft_bulk.py)
        return "int4 (int8 reads)"
    return precision
