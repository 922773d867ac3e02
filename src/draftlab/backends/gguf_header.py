"""The weight types of a GGUF's tensors, read from its header without parsing its metadata's values.

`gguf.GGUFReader` builds an array view of every metadata field: for a 49,152-token vocabulary (SmolLM2) that is
seconds, paid by every process that loads a GGUF on llama.cpp (each `draftlab serve`, each engine's preflight in a
study) only to learn its tensors' types. Here the metadata is skipped by its lengths (a string's length, an array's
count and item size) and only the tensor infos are read: milliseconds. The layout is GGUF's (versions 2 and 3, little
endian): magic `GGUF`, version u32, tensor count u64, metadata count u64; each metadata entry a key (u64 length,
bytes), a value type u32 and its value; then per tensor a name, a dimension count u32, the dimensions u64 each, a type
u32 and an offset u64. Anything else (another version, a big-endian file, a truncated one) raises `ValueError`.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path

_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUFValueType -> bytes
_STRING, _ARRAY = 8, 9


def header_tensor_types(path: str | Path) -> list[int]:
    """Each tensor's ggml type id (`gguf.GGMLQuantizationType`), in the header's order."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        if data[:4] != b"GGUF":
            raise ValueError("not a GGUF file (no GGUF magic)")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", data, 4)
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (a big-endian file, or one this reader does not know)")
        at = 24
        for _ in range(n_kv):
            at = _skip_string(data, at)
            (kind,) = struct.unpack_from("<I", data, at)
            at = _skip_value(data, at + 4, kind)
        types = []
        for _ in range(n_tensors):
            at = _skip_string(data, at)
            (dims,) = struct.unpack_from("<I", data, at)
            (kind,) = struct.unpack_from("<I", data, at + 4 + 8 * dims)
            types.append(kind)
            at += 4 + 8 * dims + 4 + 8
        return types


def _skip_string(data: mmap.mmap, at: int) -> int:
    (length,) = struct.unpack_from("<Q", data, at)
    end = at + 8 + length
    if end > len(data):
        raise ValueError("the header runs past the end of the file")
    return end


def _skip_value(data: mmap.mmap, at: int, kind: int) -> int:
    """The offset after a metadata value of this type."""
    if kind in _SCALAR_SIZES:
        return at + _SCALAR_SIZES[kind]
    if kind == _STRING:
        return _skip_string(data, at)
    if kind != _ARRAY:
        raise ValueError(f"unknown GGUF value type {kind}")
    item, count = struct.unpack_from("<IQ", data, at)
    at += 12
    if item in _SCALAR_SIZES:
        return at + count * _SCALAR_SIZES[item]
    for _ in range(count):
        at = _skip_value(data, at, item)
    return at
