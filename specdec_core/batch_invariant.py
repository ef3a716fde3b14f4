"""Row-wise attention: a token's logits no longer depend on how tokens are grouped.

Speculative decoding verifies k tokens in one forward where plain decoding runs
them one at a time; the prompt is prefilled in one piece or several. With torch's
fused attention those groupings run different kernels and blockings, so the
numbers differ in the last bits — and after int8 activation rounding, by whole
quantisation steps, enough to flip near-tied argmaxes (measured on the 0.5B draft:
max logit difference 2.8 between a 60-token forward and 60 one-token steps).

Here every query row attends through the same call a one-token decoding step
makes: `scaled_dot_product_attention` of one query over exactly its causal prefix
of keys. Together with the per-token int8 linears (quant_cpu) and the row-wise
norms, rotary and MLP activations of the model, a forward then gives bitwise the
same logits for a token whatever else is in the batch (tests/test_batch_invariant.py),
so greedy speculative decoding reproduces the int8 target's own greedy decoding.
Single sequences only (batch 1, no padding, no sliding window): what the engine runs.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

NAME = "specdec_rowwise"


def rowwise_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """query: [1, H, q, D]; key/value: [1, H_kv, kv, D] -> ([1, q, H, D], None)."""
    q_len, kv_len = query.shape[2], key.shape[2]
    gqa = query.shape[1] != key.shape[1]
    rows = []
    for i in range(q_len):
        n = kv_len - q_len + i + 1  # row i sees the cache and the batch up to itself
        rows.append(
            F.scaled_dot_product_attention(
                query[:, :, i : i + 1], key[:, :, :n], value[:, :, :n], scale=scaling, enable_gqa=gqa
            )
        )
    out = rows[0] if q_len == 1 else torch.cat(rows, dim=2)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, rowwise_attention)


def supports_rowwise(config: Any) -> bool:
    """Row-wise attention assumes plain causal attention over the whole prefix."""
    text = config.get_text_config()
    if getattr(text, "use_sliding_window", False) and getattr(text, "sliding_window", None):
        return False
    layer_types = getattr(text, "layer_types", None) or []
    return all(t == "full_attention" for t in layer_types)


def make_batch_invariant(model: Any) -> bool:
    """Switch a loaded model to row-wise attention; False when its attention is not plain causal."""
    if not supports_rowwise(model.config):
        return False
    model.set_attn_implementation(NAME)
    return True
