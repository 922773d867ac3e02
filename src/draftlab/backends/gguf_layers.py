"""Layer self-drafts on llama.cpp: a GGUF of some of the target's layers with its embeddings, final norm and head.

A layer self-draft (`layers:0-3`, `layers:0-27:4`) runs some of the target's layers, then its final norm and LM head
(early exit). On torch draftlab runs it on the target's own weights; llama.cpp runs whole models only, so draftlab
writes those tensors as a model of their own (the kept layers renumbered in order, `block_count` their number) and
drafts from it like from any model draft, in its own context. Every tensor is copied byte for byte (same weight type,
same values), so the draft is the target's early exit on the same kernels; only its cache is its own (it prefills
the prompt itself). Per-layer metadata arrays (a value per layer) keep the kept layers' values.

The file is written once into draftlab's cache, keyed by the target file (path, size, time) and the layers, through a
temporary name, with its own SHA256 beside it; a cached file whose checksum no longer matches is written again.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

from draftlab.errors import DraftlabError
from draftlab.files.assets import sha256_file
from draftlab.files.safeio import write_atomic

BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")  # a layer's tensor: blk.<layer>.<name>


def layers_label(layers: tuple[int, ...]) -> str:
    """A file-name-safe label of a layer list: (0, 1, 2, 3) -> '0-3'; (0, 4, 8) -> '0.4.8'."""
    if list(layers) == list(range(layers[0], layers[-1] + 1)):
        return f"{layers[0]}-{layers[-1]}"
    return ".".join(map(str, layers))


def layer_draft_path(source: Path, layers: tuple[int, ...], cache_root: Path) -> Path:
    """Where `derive_layer_draft` writes the draft of `layers` of `source` (a GGUF): keyed by the source's path, size
    and modification time (hashing a 1 GB target on every load would cost seconds)."""
    stat = source.stat()
    key = hashlib.sha256(f"{source.resolve()} {stat.st_size} {stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_root / "layer-drafts" / key / f"{source.stem}.layers-{layers_label(layers)}.gguf"


def derive_layer_draft(source: Path, layers: tuple[int, ...], cache_root: Path) -> Path:
    """The GGUF of `layers` (ascending, distinct, within the model) of `source` with its embeddings, final norm and
    head, written once and cached; the cached file's path."""
    check_layers(layers, None, source)
    out = layer_draft_path(source, layers, cache_root)
    checksum = out.with_name(out.name + ".sha256")
    if out.exists() and checksum.exists() and checksum.read_text().strip() == sha256_file(out):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.parent / f".{out.name}.{os.getpid()}.partial"
    try:
        write_layers(source, layers, partial)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    write_atomic(checksum, sha256_file(partial) + "\n")
    partial.replace(out)
    return out


def write_layers(source: Path, layers: tuple[int, ...], out: Path) -> None:
    """Write `out`: `source` with only `layers`, renumbered 0..len-1, and every other tensor as it is."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    try:
        reader = GGUFReader(source)
    except (ValueError, OSError) as exc:
        raise DraftlabError(f"cannot read GGUF {source} for a layer draft: {exc}") from exc
    try:
        arch = reader.fields["general.architecture"].contents()
        count = int(reader.fields[f"{arch}.block_count"].contents())
    except KeyError as exc:
        raise DraftlabError(f"GGUF {source} names no {exc}: not a model a layer draft can be cut from") from exc
    check_layers(layers, count, source)
    writer = GGUFWriter(out, arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue  # the header's own fields; the writer adds the architecture
        value = field.contents()
        if field.name == f"{arch}.block_count":
            value = len(layers)
        elif field.name.startswith(f"{arch}.") and isinstance(value, list) and len(value) == count:
            value = [value[i] for i in layers]  # a value per layer
        if field.name == "general.alignment":
            writer.data_alignment = int(value)
        sub_type = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, field.types[0], sub_type)
    kept = [(renamed(t.name, layers), t) for t in reader.tensors]
    kept = [(name, t) for name, t in kept if name is not None]
    for name, tensor in kept:
        writer.add_tensor_info(name, tensor.data.shape, tensor.data.dtype, tensor.data.nbytes, tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, tensor in kept:
        writer.write_tensor_data(tensor.data)
    writer.close()


def check_layers(layers: tuple[int, ...], count: int | None, source: Path) -> None:
    """Refuse a layer list that is empty, out of order, repeated or beyond the model's `count` layers (None: not
    read yet)."""
    if not layers or list(layers) != sorted(set(layers)) or layers[0] < 0 or layers[-1] >= (count or layers[-1] + 1):
        within = f" within 0-{count - 1}" if count else ""
        raise DraftlabError(f"a layer draft of {source.name} needs distinct layers in ascending order{within}, got "
                            f"{list(layers)}")


def renamed(name: str, layers: tuple[int, ...]) -> str | None:
    """A tensor's name in the draft: a kept layer's renumbered, any other layer's None, the rest unchanged."""
    match = BLOCK.match(name)
    if match is None:
        return name
    layer = int(match.group(1))
    return f"blk.{layers.index(layer)}.{match.group(2)}" if layer in layers else None
