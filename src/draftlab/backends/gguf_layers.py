"""Layer self-drafts on llama.cpp: a GGUF of some of the target's layers with its embeddings, final norm and head.

A layer self-draft (`layers:0-3`, `layers:0-27:4`) runs some of the target's layers, then its final norm and LM head
(early exit). On torch draftlab runs it on the target's own weights; llama.cpp runs whole models only, so draftlab
writes those tensors as a model of their own (the kept layers renumbered in order, `block_count` their number) and
drafts from it like from any model draft, in its own context. Every tensor is copied byte for byte (same weight type,
same values), so the draft is the target's early exit on the same kernels; only its cache is its own (it prefills
the prompt itself). Per-layer metadata arrays (a value per layer) keep the kept layers' values.

The file is derived once into draftlab's cache (`draftlab.backends.gguf_derive`).
"""

from __future__ import annotations

import re
from pathlib import Path

from draftlab.backends.gguf_derive import derive_once, derived_path, read_gguf, write_gguf
from draftlab.errors import DraftlabError

BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")  # a layer's tensor: blk.<layer>.<name>


def layers_label(layers: tuple[int, ...]) -> str:
    """A file-name-safe label of a layer list: (0, 1, 2, 3) -> '0-3'; (0, 4, 8) -> '0.4.8'."""
    if list(layers) == list(range(layers[0], layers[-1] + 1)):
        return f"{layers[0]}-{layers[-1]}"
    return ".".join(map(str, layers))


def layer_draft_path(source: Path, layers: tuple[int, ...], cache_root: Path) -> Path:
    """Where `derive_layer_draft` writes the draft of `layers` of `source` (a GGUF)."""
    return derived_path(source, "layer-drafts", f"{source.stem}.layers-{layers_label(layers)}.gguf", cache_root)


def derive_layer_draft(source: Path, layers: tuple[int, ...], cache_root: Path) -> Path:
    """The GGUF of `layers` (ascending, distinct, within the model) of `source` with its embeddings, final norm and
    head, written once and cached; the cached file's path."""
    check_layers(layers, None, source)
    return derive_once(layer_draft_path(source, layers, cache_root),
                       lambda partial: write_layers(source, layers, partial))


def write_layers(source: Path, layers: tuple[int, ...], out: Path) -> None:
    """Write `out`: `source` with only `layers`, renumbered 0..len-1, and every other tensor as it is."""
    reader, arch = read_gguf(source, "a layer draft")
    try:
        count = int(reader.fields[f"{arch}.block_count"].contents())
    except KeyError as exc:
        raise DraftlabError(f"GGUF {source} names no {exc}: not a model a layer draft can be cut from") from exc
    check_layers(layers, count, source)

    def value_of(name: str, value):
        if name == f"{arch}.block_count":
            return len(layers)
        if name.startswith(f"{arch}.") and isinstance(value, list) and len(value) == count:
            return [value[i] for i in layers]  # a value per layer
        return value

    kept = [(renamed(t.name, layers), t) for t in reader.tensors]
    write_gguf(reader, arch, out, value_of, [(name, t.data, t.tensor_type) for name, t in kept if name is not None])


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
