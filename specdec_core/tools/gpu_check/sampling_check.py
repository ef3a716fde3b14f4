"""Speculative sampling on a device draws from the target's distribution: a Pearson test.

A tiny model (12-token vocabulary, weights drawn wide enough that its distributions are
peaked, so a few hundred samples fill the test's cells) and a perturbed copy as its draft
run on the device; each of `samples` seeded generations of three tokens makes one verify
of two drafts, and the first two tokens (x1, x2) must follow P(x1) P(x2 | x1) of plain sampling from the
target, computed from its logits on the same device. The p-value of Pearson's chi-square
of the counts against that joint is reported (cells expected under 5 merged, so the
test's approximation holds); a correct sampler gives a p-value spread uniformly in (0, 1).
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass
from typing import Any

import torch
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from ...engine.drafters import ModelDrafter
from ...engine.speculative import GenerationParams, SpeculativeEngine
from .identity import last

VOCAB = 12
PROMPT = [1, 2, 3]


@dataclass(frozen=True)
class SamplingCheck:
    samples: int
    p_value: float
    acceptance: float  # accepted / proposed draft tokens: the draft was really used

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)


def pearson_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """P(chi-square >= the statistic) for observed `counts` against `probs` (rare cells merged)."""
    counts, probs = counts.double().cpu(), probs.double().cpu()
    expected = probs / probs.sum() * counts.sum()
    keep = expected >= 5
    observed = torch.cat([counts[keep], counts[~keep].sum().unsqueeze(0)])
    wanted = torch.cat([expected[keep], expected[~keep].sum().unsqueeze(0)])
    if wanted[-1] == 0:
        observed, wanted = observed[:-1], wanted[:-1]
    if len(wanted) < 2:
        raise ValueError("too few samples for a chi-square test: fewer than two cells expect 5")
    statistic = ((observed - wanted) ** 2 / wanted).sum()
    dof = torch.tensor(float(len(wanted) - 1), dtype=torch.float64)
    return float(torch.special.gammaincc(dof / 2, statistic / 2))


def _tiny_pair(device: str) -> tuple[Any, Any]:
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         bos_token_id=None, eos_token_id=None, pad_token_id=0,
                         initializer_range=0.2)  # fmt: skip
    torch.manual_seed(3)
    target: Any = Qwen2ForCausalLM(config)
    target = target.to(device).eval()
    draft = copy.deepcopy(target)
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(0.5 * p.std().nan_to_num() * torch.randn(p.shape, generator=gen).to(device))
    return target, draft


def _tokenizer() -> PreTrainedTokenizerFast:
    vocab = {f"w{i}": i for i in range(VOCAB)}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="w0")))


def check_sampling(device: str, samples: int) -> SamplingCheck:
    """Sample (x1, x2) `samples` times through the engine at temperature 1 on `device`."""
    target, draft = _tiny_pair(device)
    params = GenerationParams(max_new_tokens=3, temperature=1.0, draft_length=2, max_draft_length=2)
    with torch.no_grad():
        first = torch.softmax(target(torch.tensor([PROMPT], device=device)).logits[0, -1].float(), -1)
        rows = torch.tensor([[*PROMPT, t] for t in range(VOCAB)], device=device)
        second = torch.softmax(target(rows).logits[:, -1].float(), -1)
    joint = (first[:, None] * second).flatten()
    engine = SpeculativeEngine(target, _tokenizer(), ModelDrafter(draft, "perturbed"))
    counts = torch.zeros(VOCAB * VOCAB, dtype=torch.long)
    accepted = proposed = 0
    for seed in range(samples):
        done = last(engine.generate(PROMPT, GenerationParams(**{**params.__dict__, "seed": seed})))
        x1, x2 = done.token_ids[:2]
        counts[x1 * VOCAB + x2] += 1
        accepted += done.stats.accepted
        proposed += done.stats.proposed
    return SamplingCheck(samples, pearson_p_value(counts, joint), accepted / max(proposed, 1))
