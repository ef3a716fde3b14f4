"""The document `specdec bench --json` writes: the results, their summary and the bars checked."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from .results import GroupSummary, Result, summarize
from .targets import TargetCheck, check_targets


@dataclass
class BenchReport:
    """Everything `--json` writes: {"config", "machine", "results", "summary"}."""

    config: dict[str, Any]
    machine: dict[str, Any]
    results: list[Result]
    summary: dict[str, dict[str, GroupSummary]] = field(default_factory=dict)
    targets: list[TargetCheck] = field(default_factory=list)

    @classmethod
    def build(cls, config: dict[str, Any], machine: dict[str, Any], results: list[Result]) -> BenchReport:
        summary = summarize(results)
        return cls(config, machine, results, summary, check_targets(results))

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> BenchReport:
        """A saved `--json` document, summarised again (by this version's rules)."""
        return cls.build(doc["config"], doc["machine"], [Result.from_dict(r) for r in doc["results"]])

    def as_dict(self) -> dict[str, Any]:
        return {
            "config": self.config,
            "machine": self.machine,
            "results": [r.as_dict() for r in self.results],
            "summary": {
                "methods": {
                    m: {g: asdict(s) for g, s in groups.items()} for m, groups in self.summary.items()
                },
                "targets": [asdict(t) for t in self.targets],
            },
        }
