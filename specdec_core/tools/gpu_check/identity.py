"""Greedy identity: with any drafter at any pinned draft length, the tokens of the target alone.

Each prompt is answered by the target alone (k = 0), then with each drafter at every
pinned k (a verify of k + 1 rows); "identity" is the share of (k, prompt) runs whose
tokens equal the target alone's, and each failing run is listed. A model drafting for
itself has every draft accepted when verify rows equal plain steps, so every row of the
widest verify is compared; its acceptance is reported to show the widths were reached.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ...engine.drafters import DraftStrategy, NoDrafter
from ...engine.events import DoneEvent, Event
from ...engine.speculative import GenerationParams, SpeculativeEngine


def last(events: Iterable[Event]) -> DoneEvent:
    """The generation's closing event, after running it to its end."""
    *_, done = events
    if not isinstance(done, DoneEvent):
        raise RuntimeError(f"a generation ended on {type(done).__name__}, not DoneEvent")
    return done


def _answer(
    engine: SpeculativeEngine, prompt: Sequence[int], new_tokens: int, k: int
) -> tuple[list[int], Any]:
    params = GenerationParams(max_new_tokens=new_tokens, draft_length=k, max_draft_length=max(k, 1))
    done = last(engine.generate(list(prompt), params))
    return list(done.token_ids), done.stats


def greedy_identity(
    engine: SpeculativeEngine,
    prompts: Sequence[Sequence[int]],
    new_tokens: int,
    drafters: Mapping[str, DraftStrategy],
    ks: Sequence[int],
) -> dict[str, dict[str, Any]]:
    """Per drafter: identity share, the (k, prompt index) runs that differed, and the acceptance."""
    engine.set_drafter(NoDrafter())
    alone = [_answer(engine, p, new_tokens, 0)[0] for p in prompts]
    found: dict[str, dict[str, Any]] = {}
    for name, drafter in drafters.items():
        engine.set_drafter(drafter)
        differed: list[list[int]] = []
        accepted = proposed = 0
        for k in ks:
            for index, prompt in enumerate(prompts):
                tokens, stats = _answer(engine, prompt, new_tokens, k)
                accepted, proposed = accepted + stats.accepted, proposed + stats.proposed
                if tokens != alone[index]:
                    differed.append([k, index])
        runs = len(ks) * len(prompts)
        found[name] = {
            "identity": (runs - len(differed)) / runs,
            "runs": runs,
            "differed_k_prompt": differed,
            "acceptance": accepted / proposed if proposed else 0.0,
        }
    engine.set_drafter(NoDrafter())
    return found
