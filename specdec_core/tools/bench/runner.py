"""Running the bench: every method on every prompt, interleaved, after a warm-up.

For each prompt and repeat the methods run one after another, so drift of a shared
machine hits all methods alike, and the order rotates from one (prompt, repeat) to the
next (A B C, then B C A, …), so no method always runs in the same place (always right
after the peer's server, say, or always after a method that leaves the machine warmer).
Every method starts from empty caches: our engine would otherwise reuse the previous
repeat's prompt cache, which transformers cannot.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ...engine.selfcheck import check_exactness as selfcheck
from .methods import GREEDY, Decoding, EngineMethod, Method, Run
from .prompts import BenchPrompt, encode_prompt
from .results import Result, prompt_results


@dataclass(frozen=True)
class BenchProgress:
    done: int
    total: int
    prompt_id: str
    method: str
    last_tokens_per_s: float | None


@dataclass(frozen=True)
class BenchSettings:
    max_new_tokens: int = 128
    repeats: int = 1
    warmup_tokens: int = 16
    decoding: Decoding = GREEDY


def check_exactness(methods: dict[str, Method]) -> dict[str, object] | None:
    """Run the exactness self-check once for the loaded pair; every engine gets the report.

    The check compares a k-token verify with k plain steps of the target, so one run
    covers all our methods (they share the target model). None when no engine runs.
    """
    engines = [m.engine for m in methods.values() if isinstance(m, EngineMethod)]
    if not engines:
        return None
    report = selfcheck(engines[0])
    for engine in engines:
        engine.exactness = report
    return report.as_dict()


def run_bench(
    methods: dict[str, Method],
    prompts: Sequence[BenchPrompt],
    tokenizer: Any,
    settings: BenchSettings,
    progress: Callable[[BenchProgress], None] | None = None,
    exactness: str = "unchecked",
) -> list[Result]:
    """Warm every method up, then time prompt by prompt, repeat by repeat, method by method."""
    encoded = [encode_prompt(tokenizer, p) for p in prompts]
    total = len(prompts) * settings.repeats * len(methods)
    for name, method in methods.items():  # warm-up: first-call allocations, lazy inits, caches
        if progress:
            progress(BenchProgress(0, total, "warm-up", name, None))
        method.run(encoded[0], min(settings.warmup_tokens, settings.max_new_tokens))
    results: list[Result] = []
    done = 0
    names = list(methods)
    turn = 0
    for prompt, ids in zip(prompts, encoded, strict=True):
        runs: dict[str, list[Run]] = {name: [] for name in methods}
        for _ in range(settings.repeats):
            shift = turn % len(names)
            turn += 1
            for name in names[shift:] + names[:shift]:
                method = methods[name]
                run = method.run(ids, settings.max_new_tokens)
                runs[name].append(run)
                done += 1
                if progress:
                    tps = len(run.token_ids) / run.seconds if run.seconds > 0 else 0.0
                    progress(BenchProgress(done, total, prompt.id, name, tps))
        results.extend(prompt_results(prompt, len(ids), runs, exactness, sampled=not settings.decoding.greedy))
    return results
