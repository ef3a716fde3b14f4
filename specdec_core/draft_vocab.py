"""A draft whose LM head scores only the most useful N token ids.

The draft's output head is a large share of its weights (Qwen2.5 0.5B: 151,936 rows
x 896, 28% of the model), read in full at every draft forward. Restricting it to N
rows makes each draft token cheaper; the draft then never proposes the other ids.
Exactness is untouched: the target verifies every token, and the draft's q is padded
with zeros (probability 0 outside the kept rows), so the rejection rule still gives
the target's distribution; a token the draft cannot propose is simply not drafted.

Which rows: byte-level BPE vocabularies number tokens in merge order, and early
merges are the frequent pairs, so the lowest ids are the most used ones; the stop
tokens (end of turn) are always kept so the draft can propose the end of an answer.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from .drafters import ModelDrafter
from .quant_cpu import PerTokenInt8Linear


def useful_rows(vocab_size: int, n: int, always: Iterable[int] = ()) -> torch.Tensor:
    """The kept ids, sorted: the n lowest ids plus `always` (stop tokens)."""
    keep = set(range(min(n, vocab_size))) | {i for i in always if 0 <= i < vocab_size}
    return torch.tensor(sorted(keep), dtype=torch.long)


def truncated_head_model(model: Any, rows: torch.Tensor) -> nn.Module:
    """A view of `model` sharing its body, with an LM head of only `rows` (logits [.., len(rows)]).

    The original model is left as it is (a bench or the app may use it as a full draft).
    """
    head = model.get_output_embeddings()
    new_head: nn.Module
    if isinstance(head, PerTokenInt8Linear):
        values, scales = head.int8_weight()
        new_head = PerTokenInt8Linear.from_int8(values[rows], scales[rows], None, head.kernel.name)
    else:
        new_head = nn.Linear(head.in_features, len(rows), bias=False)
        with torch.no_grad():
            new_head.weight.copy_(head.weight.detach()[rows])
        new_head.to(dtype=head.weight.dtype, device=head.weight.device)
    view = copy.copy(model)
    view._modules = dict(model._modules)  # the body's modules are shared, only the head differs
    view.set_output_embeddings(new_head)
    return view


def truncate_draft(drafter: ModelDrafter, n: int, always: Iterable[int] = ()) -> ModelDrafter:
    """The same draft model scoring only the n most useful ids (plus `always`), as a new drafter."""
    model: Any = drafter.runner.model
    vocab = drafter.vocab_size or model.get_output_embeddings().out_features
    rows = useful_rows(vocab, n, always)
    small = ModelDrafter(truncated_head_model(model, rows), f"{drafter.name}[{len(rows)}]", vocab)
    small.rows = rows
    return small
