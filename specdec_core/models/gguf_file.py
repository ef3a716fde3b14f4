"""A GGUF file's header and tensor table, and its tensors as views of one read-only mapping.

The `gguf` package's reader builds a numpy object for every item of every array in the
header, a tokenizer's hundreds of thousands of strings included, which takes many
seconds. A load needs only the scalar fields and where each tensor is, so this reader
steps over arrays by their lengths and maps the file once: a tensor's bytes are read
from the page cache when a forward touches them, never copied.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ModelLoadError

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_MIN_TENSOR_INFO = 8 + 4 + 8 + 4 + 8  # name length, dims count, one dim, type, offset
_MIN_FIELD = 8 + 4 + 1  # key length, type, the smallest value


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]  # innermost first, as GGUF lists them: a linear's (in, out)
    qtype: int  # a ggml type id (gguf.GGMLQuantizationType)
    offset: int  # from the start of the data section


@dataclass
class GGUFFile:
    path: Path
    fields: dict[str, Any]  # scalars and strings; arrays as their lengths (`array_lengths`)
    array_lengths: dict[str, int]
    tensors: dict[str, TensorInfo]
    data_start: int
    mapping: np.ndarray  # the whole file, read-only
    # The short arrays of numbers (a per-layer pattern): their values. Strings and long
    # arrays (a vocabulary) are stepped over, their lengths only kept, and where each starts
    # (`read_arrays` decodes one there when asked).
    numbers: dict[str, list[Any]] = field(default_factory=dict)
    array_offsets: dict[str, int] = field(default_factory=dict)

    @property
    def architecture(self) -> str:
        return str(self.fields.get("general.architecture", ""))

    @property
    def file_type(self) -> str:
        """llama.cpp's name for the file's quantization mix ("Q4_K_M"), or "" when unrecorded."""
        from gguf import LlamaFileType

        value = self.fields.get("general.file_type")
        try:
            return LlamaFileType(int(value)).name.removeprefix("MOSTLY_") if value is not None else ""
        except ValueError:
            return ""

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as stored: [rows, bytes per row] for a matrix, flat otherwise."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        info = self.tensors[name]
        block, type_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(info.qtype)]
        rows = int(np.prod(info.dims[1:])) if len(info.dims) > 1 else 1
        row_bytes = info.dims[0] // block * type_bytes
        start = self.data_start + info.offset
        data = self.mapping[start : start + rows * row_bytes]
        if data.size != rows * row_bytes:
            raise ModelLoadError(f"{self.path.name}: tensor {name} runs past the end of the file (truncated?)")
        return data.reshape(rows, row_bytes) if len(info.dims) > 1 else data

    def drop_pages(self, name: str) -> None:
        """Let the process's resident memory drop the tensor's pages (a copy now holds its
        values): they stay in the page cache, and are read again if the tensor is touched."""
        advise = getattr(mmap, "MADV_DONTNEED", None)
        buffer = self.mapping.base
        buffer = buffer.obj if isinstance(buffer, memoryview) else buffer  # np.frombuffer's view of the map
        if advise is None or not isinstance(buffer, mmap.mmap):
            return
        raw = self.raw(name)
        start = self.data_start + self.tensors[name].offset
        first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE  # whole pages inside the tensor only
        last = (start + raw.size) // mmap.PAGESIZE * mmap.PAGESIZE
        if last > first:
            buffer.madvise(advise, first, last - first)

    def floats(self, name: str) -> np.ndarray:
        """An F32 tensor's values (norm weights, biases), as a view of the file."""
        info = self.tensors[name]
        if info.qtype != 0:
            raise ModelLoadError(f"{self.path.name}: {name} is not an F32 tensor (ggml type {info.qtype})")
        return self.raw(name).view(np.float32).reshape(tuple(reversed(info.dims)))


def read_gguf(path: Path) -> GGUFFile:
    """The header and tensor table of `path`; one line if it is not a well-formed GGUF file."""
    try:
        with open(path, "rb") as handle:
            mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        mapping = np.frombuffer(mapped, dtype=np.uint8)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {path.name}: {exc}") from None
    try:
        return _parse(path, mapping)
    except (struct.error, UnicodeDecodeError, IndexError, ValueError) as exc:
        raise ModelLoadError(
            f"{path.name} is a damaged or truncated GGUF file ({mapping.size} bytes; {exc}): download it again"
        ) from None


class _Cursor:
    def __init__(self, buffer: memoryview, at: int = 0) -> None:
        self.buffer, self.at = buffer, at

    def take(self, fmt: str) -> Any:
        value = struct.unpack_from(fmt, self.buffer, self.at)[0]
        self.at += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.take("<Q")
        text = bytes(self.buffer[self.at : self.at + length]).decode("utf-8")
        if len(text.encode("utf-8")) != length:
            raise ValueError("a string runs past the end of the header")
        self.at += length
        return text

    def skip_string(self) -> None:
        length = self.take("<Q")
        self.at += length


def _parse(path: Path, mapping: np.ndarray) -> GGUFFile:
    cursor = _Cursor(memoryview(mapping.data))
    if bytes(mapping[:4]) != MAGIC:
        raise ModelLoadError(f"{path.name} is not a GGUF file (it does not start with 'GGUF')")
    cursor.at = 4
    version = cursor.take("<I")
    if version not in (2, 3):
        raise ModelLoadError(f"{path.name}: GGUF version {version} is not supported (2 and 3 are)")
    n_tensors, n_fields = cursor.take("<Q"), cursor.take("<Q")
    if n_tensors * _MIN_TENSOR_INFO + n_fields * _MIN_FIELD > mapping.size:
        raise ValueError(f"its header counts {n_tensors} tensors and {n_fields} fields")
    fields: dict[str, Any] = {}
    lengths: dict[str, int] = {}
    numbers: dict[str, list[Any]] = {}
    offsets: dict[str, int] = {}
    for _ in range(n_fields):
        key = cursor.string()
        kind = cursor.take("<I")
        if kind == _ARRAY:
            offsets[key] = cursor.at
            lengths[key] = _skip_array(cursor)
            values = _short_numbers(cursor.buffer, offsets[key])
            if values is not None:
                numbers[key] = values
        else:
            fields[key] = _value(cursor, kind)
    tensors = {}
    for _ in range(n_tensors):
        name = cursor.string()
        n_dims = cursor.take("<I")
        dims = tuple(cursor.take("<Q") for _ in range(n_dims))
        tensors[name] = TensorInfo(name, dims, cursor.take("<I"), cursor.take("<Q"))
    alignment = int(fields.get("general.alignment", DEFAULT_ALIGNMENT))
    data_start = -(-cursor.at // alignment) * alignment
    end = max((data_start + t.offset + _nbytes(t) for t in tensors.values()), default=0)
    if end > mapping.size or not tensors:
        raise ModelLoadError(
            f"{path.name} is a truncated GGUF file: {mapping.size} bytes, its tensors need {end}; download it again"
        )
    return GGUFFile(path, fields, lengths, tensors, data_start, mapping, numbers, offsets)


def _nbytes(info: TensorInfo) -> int:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, type_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(info.qtype)]
    return int(np.prod(info.dims)) // block * type_bytes


def _value(cursor: _Cursor, kind: int) -> Any:
    if kind == _STRING:
        return cursor.string()
    fmt = _SCALARS.get(kind)
    if fmt is None:
        raise ValueError(f"unknown field type {kind}")
    return cursor.take(fmt)


SHORT_ARRAY = 4096  # items: a per-layer array of any model, not a vocabulary's scores


def _short_numbers(buffer: memoryview, start: int) -> list[Any] | None:
    """The values of the array of numbers at `start` when it is short, else None."""
    kind, count = struct.unpack_from("<IQ", buffer, start)
    if kind not in _SCALARS or count > SHORT_ARRAY:
        return None
    return _array(_Cursor(buffer, start))


def _skip_array(cursor: _Cursor) -> int:
    kind, count = cursor.take("<I"), cursor.take("<Q")
    if kind == _STRING:
        for _ in range(count):
            cursor.skip_string()
    elif kind == _ARRAY:
        for _ in range(count):
            _skip_array(cursor)
    else:
        fmt = _SCALARS.get(kind)
        if fmt is None:
            raise ValueError(f"unknown array item type {kind}")
        cursor.at += struct.calcsize(fmt) * count
    return count


def read_arrays(file: GGUFFile, keys: Iterable[str]) -> dict[str, list[Any]]:
    """The header arrays named in `keys` that `file` holds (strings or numbers), decoded where
    `read_gguf` found them; it only counts them, a vocabulary being hundreds of thousands of strings."""
    buffer = memoryview(file.mapping.data)
    return {key: _array(_Cursor(buffer, file.array_offsets[key])) for key in keys if key in file.array_offsets}


def _array(cursor: _Cursor) -> list[Any]:
    kind, count = cursor.take("<I"), cursor.take("<Q")
    if kind == _STRING:
        return [cursor.string() for _ in range(count)]
    if kind == _ARRAY:
        return [_array(cursor) for _ in range(count)]
    fmt = _SCALARS.get(kind)
    if fmt is None:
        raise ValueError(f"unknown array item type {kind}")
    values = list(struct.unpack_from(f"<{count}{fmt[1]}", cursor.buffer, cursor.at))
    cursor.at += struct.calcsize(fmt) * count
    return values
