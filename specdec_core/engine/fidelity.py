"""How far a model's next-token distributions are from a reference's, on the same text.

Exactness makes the answer the loaded target's own; fidelity says how far that target is
from the weights the user meant (the file's, in fp32). Measured the way llama.cpp's
`llama-perplexity` does, so the figures compare with its: the text is cut into chunks of
`ctx` tokens, each read from an empty cache, and only the second half of each chunk is
scored (every scored token then has at least ctx/2 tokens of context). Where the vocabulary
adds a BOS token (Llama, Gemma), the text's tokens start with it and each chunk's first
token is replaced by it (`chunk_ids`), as llama-perplexity does: such a model is only ever
read after a BOS, and without it the figures would not be the model's nor comparable.

Per scored position: the model's and the reference's log-probabilities of the next
token (perplexity), KL(reference || model) over the whole vocabulary, and whether both
put the same token first.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from ..kernels.cpu.runner import CachedModel

DEFAULT_CTX = 512  # llama-perplexity's default context


@dataclass(frozen=True)
class Fidelity:
    chunks: int
    scored: int  # positions scored, over all chunks
    ctx: int
    perplexity: float
    reference_perplexity: float
    kl_mean: float
    kl_p99: float
    top1_agreement: float  # share of positions where both models rank the same token first

    @property
    def perplexity_change(self) -> float:
        """Relative change against the reference: +0.04 is 4% worse."""
        return self.perplexity / self.reference_perplexity - 1.0

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "perplexity_change": self.perplexity_change}

    def summary(self) -> str:
        return (
            f"perplexity {self.perplexity:.4f} vs {self.reference_perplexity:.4f} "
            f"({self.perplexity_change:+.2%}), KL mean {self.kl_mean:.4f} p99 {self.kl_p99:.4f}, "
            f"top-1 agrees {self.top1_agreement:.1%} ({self.scored} positions in {self.chunks} chunks "
            f"of {self.ctx})"
        )


def document_ids(tokenizer: Any, text: str, bos: int | None) -> list[int]:
    """A text's token ids as llama-perplexity reads them: no special token but a leading `bos`
    (None where the vocabulary adds none)."""
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return ids if bos is None else [bos, *ids]


def tokenizer_bos(tokenizer: Any) -> int | None:
    """The BOS id a tokenizer puts before a text when asked for its special tokens, or None."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return None
    plain = list(tokenizer("a", add_special_tokens=False)["input_ids"])
    special = list(tokenizer("a", add_special_tokens=True)["input_ids"])
    return bos if special[: len(plain) + 1] == [bos, *plain] else None


def chunk_ids(ids: Sequence[int], ctx: int, bos: int | None = None) -> list[list[int]]:
    """Consecutive whole chunks of `ctx` tokens (a shorter tail is left out), each with `bos` in
    place of its first token where one is given: llama-perplexity's chunks."""
    if ctx < 4:
        raise ValueError(f"the context must be at least 4 tokens, not {ctx}")
    chunks = [list(ids[start : start + ctx]) for start in range(0, len(ids) - ctx + 1, ctx)]
    if bos is not None:
        for chunk in chunks:
            chunk[0] = bos
    return chunks


def measure(
    model: torch.nn.Module, reference: torch.nn.Module, ids: Sequence[int], ctx: int = DEFAULT_CTX,
    bos: int | None = None,
) -> Fidelity:  # fmt: skip
    """`model` against `reference` on the token ids of a text (both with the same vocabulary);
    `bos`: the vocabulary's BOS where it adds one (`chunk_ids`)."""
    chunks = chunk_ids(ids, ctx, bos)
    if not chunks:
        raise ValueError(f"the text has {len(ids)} tokens: at least one chunk of {ctx} is needed")
    ours, theirs = CachedModel(model), CachedModel(reference)
    nll = ref_nll = 0.0
    kls: list[torch.Tensor] = []
    agree = 0
    for chunk in chunks:
        lp, ref_lp, targets = _scored(ours, chunk), _scored(theirs, chunk), _targets(chunk)
        rows = torch.arange(len(targets))
        nll -= float(lp[rows, targets].sum())
        ref_nll -= float(ref_lp[rows, targets].sum())
        kls.append((ref_lp.exp() * (ref_lp - lp)).sum(dim=-1))
        agree += int((lp.argmax(dim=-1) == ref_lp.argmax(dim=-1)).sum())
    kl = torch.cat(kls)
    scored = int(kl.numel())
    return Fidelity(
        chunks=len(chunks),
        scored=scored,
        ctx=ctx,
        perplexity=math.exp(nll / scored),
        reference_perplexity=math.exp(ref_nll / scored),
        kl_mean=float(kl.mean()),
        kl_p99=float(torch.quantile(kl.double(), 0.99)),
        top1_agreement=agree / scored,
    )


def _first_scored(ctx: int) -> int:
    return ctx // 2


def _targets(chunk: list[int]) -> torch.Tensor:
    """The tokens scored: each predicted from the logits one position before it."""
    return torch.tensor(chunk[_first_scored(len(chunk)) + 1 :], dtype=torch.long)


def _scored(runner: CachedModel, chunk: list[int]) -> torch.Tensor:
    """Log-probabilities [scored, V] at the positions whose next token is scored."""
    runner.reset()
    logits = runner.forward(chunk, logits_to_keep=len(chunk))
    runner.reset()  # the chunk's cache is not needed again
    first = _first_scored(len(chunk))
    # On the host: a model on the GPU is compared with its fp32 reference on the CPU.
    return torch.log_softmax(logits[first:-1].float(), dim=-1).cpu()
