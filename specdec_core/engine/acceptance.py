"""Deciding which draft tokens the target keeps.

Greedy: keep the longest prefix of the draft that equals the target's argmax,
then the target's argmax at the first mismatch (`corrected`) or after the last
draft token (`bonus`). The committed tokens are exactly the target's greedy ones.

Sampling: the rejection rule of Leviathan et al. 2023 / Chen et al. 2023.
Accept draft token x with probability min(1, p(x) / q(x)); on rejection draw from
the residual norm(max(0, p - q)). The committed tokens are distributed exactly as
sampling from p alone. A deterministic drafter (n-gram) has q = one-hot(x), so
acceptance is p(x) and the residual is p with x removed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampling import sample, uniforms


@dataclass(frozen=True)
class Verdict:
    accepted: int  # how many draft tokens were kept
    next_token: int  # the target's own token after them (corrected or bonus)


def accept_greedy(draft_tokens: list[int], target_logits: torch.Tensor) -> Verdict:
    """target_logits: [k + 1, V], row i predicts the token after draft position i."""
    target_ids = target_logits.argmax(dim=-1).tolist()
    n = 0
    while n < len(draft_tokens) and draft_tokens[n] == target_ids[n]:
        n += 1
    return Verdict(accepted=n, next_token=target_ids[n])


def accept_sampled(
    draft_tokens: list[int],
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
) -> Verdict:
    """draft_probs: [k, V] or None (deterministic drafter); target_probs: [k + 1, V]."""
    k = len(draft_tokens)
    draws = uniforms(k, generator)
    # Each side's probabilities of the drafts in one read: on a GPU one transfer, not k.
    ps = at_tokens(target_probs, draft_tokens)
    qs = [1.0] * k if draft_probs is None else at_tokens(draft_probs, draft_tokens)
    for i, token in enumerate(draft_tokens):
        p, q = ps[i], qs[i]
        if q > 0 and draws[i] < min(1.0, p / q):
            continue
        return Verdict(
            accepted=i, next_token=sample(_residual(i, token, draft_probs, target_probs), generator)
        )
    return Verdict(accepted=k, next_token=sample(target_probs[k], generator))


def at_tokens(probs: torch.Tensor, tokens: list[int]) -> list[float]:
    """[probs[i, tokens[i]] for each i], read from the device at once."""
    if not tokens:
        return []
    rows = torch.arange(len(tokens), device=probs.device)
    return probs[rows, torch.tensor(tokens, device=probs.device)].tolist()


def _residual(
    i: int, token: int, draft_probs: torch.Tensor | None, target_probs: torch.Tensor
) -> torch.Tensor:
    p = target_probs[i]
    if draft_probs is None:
        residual = p.clone()
        residual[token] = 0.0
    else:
        residual = (p - draft_probs[i]).clamp_min(0.0)
    total = residual.sum()
    # A zero residual only happens when q == p up to rounding; then p itself is exact.
    return residual / total if total > 0 else p
