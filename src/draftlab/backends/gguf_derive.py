"""GGUF files draftlab derives from a model's GGUF (layer drafts, trimmed draft heads): written once into draftlab's
cache, keyed by the source file (path, size, time) and what was derived, through a temporary name, with their own
SHA256 beside them; a cached file whose checksum no longer matches is written again.

Every tensor a derivation keeps is copied byte for byte (same weight type, same values): a derived draft runs the
source's own weights on the same kernels.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Callable

from draftlab.errors import DraftlabError
from draftlab.files.assets import sha256_file
from draftlab.files.safeio import write_atomic


def derived_path(source: Path, kind: str, name: str, cache_root: Path) -> Path:
    """Where a derivation of `source` named `name` lives under the cache's `kind` folder: keyed by the source's path,
    size and modification time (hashing a 1 GB target on every load would cost seconds)."""
    stat = source.stat()
    key = hashlib.sha256(f"{source.resolve()} {stat.st_size} {stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_root / kind / key / name


def derive_once(out: Path, write: Callable[[Path], None]) -> Path:
    """`out`, written by `write(partial)` unless a cached copy with a matching checksum is there."""
    checksum = out.with_name(out.name + ".sha256")
    if out.exists() and checksum.exists() and checksum.read_text().strip() == sha256_file(out):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.parent / f".{out.name}.{os.getpid()}.partial"
    try:
        write(partial)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    write_atomic(checksum, sha256_file(partial) + "\n")
    partial.replace(out)
    return out


def read_gguf(source: Path, what: str):
    """A `GGUFReader` of `source` and its architecture; one clear line for a file that is not a model's GGUF."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(source)
        return reader, reader.fields["general.architecture"].contents()
    except (ValueError, OSError) as exc:
        raise DraftlabError(f"cannot read GGUF {source} for {what}: {exc}") from exc
    except KeyError as exc:
        raise DraftlabError(f"GGUF {source} names no {exc}: not a model {what} can be made from") from exc


def write_gguf(reader, arch: str, out: Path, value_of: Callable[[str, object], object], tensors: list,
               extra: dict[str, int] | None = None) -> None:
    """Write `out`: `reader`'s metadata (each value through `value_of(name, value)`), `extra` uint32 keys, then
    `tensors` as (name, data, tensor type) in that order, their bytes as given."""
    from gguf import GGUFValueType, GGUFWriter

    writer = GGUFWriter(out, arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue  # the header's own fields; the writer adds the architecture
        value = value_of(field.name, field.contents())
        if field.name == "general.alignment":
            writer.data_alignment = int(value)
        sub_type = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, field.types[0], sub_type)
    for key, value in (extra or {}).items():
        writer.add_uint32(key, value)
    for name, data, tensor_type in tensors:
        writer.add_tensor_info(name, data.shape, data.dtype, data.nbytes, tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, data, _ in tensors:
        writer.write_tensor_data(data)
    writer.close()
