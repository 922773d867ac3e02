"""Draft directories: a JSON record naming the format, and the draft's own weights.

    draftlab_draft.json   {"format": <one of the formats below>, "version": 1, "target": ..., ...}
    weights.safetensors   the draft's own tensors

Each format is defined beside its drafter (`designed.py`: "draftlab-draft",
`feature.py`: "draftlab-feature-draft"); this module only reads what they
share, and refuses damaged files with a clear error.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from draftlab.backends.gguf_parts import gguf_target_parts
from draftlab.errors import DraftlabError
from draftlab.files.safeio import write_atomic

RECORD = "draftlab_draft.json"
WEIGHTS = "weights.safetensors"


def draft_format(path: str | Path) -> str | None:
    """The format named by a draft directory's record; None when `path` holds no record."""
    record = Path(path) / RECORD
    if not record.is_file():
        return None
    return str(read_record(Path(path)).get("format"))


def read_record(path: Path) -> dict:
    """The JSON record of a draft directory."""
    try:
        record = json.loads((path / RECORD).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise DraftlabError(f"{path} is not a readable draftlab draft ({exc}); rebuild it") from exc
    if not isinstance(record, dict):
        raise DraftlabError(f"{path}/{RECORD} is not a draftlab draft record; rebuild it")
    return record


def read_draft_files(path: str | Path, expected_format: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """The record and weights of a draft directory whose record has `expected_format`."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    record = read_record(path)
    if record.get("format") != expected_format:
        raise DraftlabError(f"{path}/{RECORD} is not a {expected_format} record")
    try:
        state = load_file(str(path / WEIGHTS))
    except (OSError, SafetensorError) as exc:
        raise DraftlabError(f"{path}/{WEIGHTS} cannot be read ({exc}); the file is damaged, rebuild the draft") from exc
    return record, state


def check_target_vocab(path: str | Path, record: dict, vocab_size: int, target_name: str) -> None:
    """Refuse a draft whose record names another target vocabulary size."""
    expected = record.get("target_vocab_size")
    if expected is not None and int(expected) != vocab_size:
        raise DraftlabError(
            f"draft {path} was built for a target with {expected} tokens; {target_name} has {vocab_size}"
        )


def load_strict(module: torch.nn.Module, state: dict[str, torch.Tensor], path: str | Path, **options) -> None:
    """`module.load_state_dict(state, strict=True)`, with a clear error for missing or unexpected keys."""
    try:
        module.load_state_dict(state, strict=True, **options)
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()[0]
        raise DraftlabError(f"draft {path} does not match its format ({first}); rebuild the draft") from exc


def own_weights(module: torch.nn.Module, vocab_map: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A draft's own tensors (in `dtype`, on the CPU) and its vocabulary map [V'] (int64): what WEIGHTS holds."""
    state = {k: v.detach().to(dtype).cpu().contiguous() for k, v in module.state_dict().items()}
    state["vocab_map"] = vocab_map.to(torch.int64).cpu()
    return state


def write_draft_files(out: str | Path, state: dict[str, torch.Tensor], record: dict) -> Path:
    """Write a draft directory: its weights, then its record, each atomically (a killed write leaves the old)."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / (WEIGHTS + ".tmp")
    save_file(state, str(tmp))
    tmp.replace(out / WEIGHTS)
    write_atomic(out / RECORD, json.dumps(record, indent=2))
    return out


@torch.no_grad()
def target_parts(target, vocab_map: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """What a one-layer draft borrows from its Llama-family target: input embeddings [V, D], the LM-head rows of
    the draft vocabulary [V', D], and the rotary tables cos, sin [P, hd] over the target's context length (of a
    target in llama.cpp: from its GGUF, `draftlab.backends.gguf_parts`)."""
    model = target.model
    if target.engine.runs_gguf:
        return gguf_target_parts(model.path, model.config, vocab_map)
    positions = torch.arange(model.config.max_position_embeddings, device=target.device)[None]
    probe = torch.zeros(1, dtype=target.dtype, device=target.device)
    cos, sin = model.model.rotary_emb(probe, positions)  # [1, P, hd]
    head = model.get_output_embeddings().weight.detach()[vocab_map.to(target.device)]  # [V', D]
    return model.model.embed_tokens.weight.detach(), head, cos[0], sin[0]


def take_vocab_map(path: str | Path, state: dict[str, torch.Tensor], vocab_size: int, target_name: str,
                   what: str) -> torch.Tensor:
    """Pop a draft's vocabulary map [V'] from its weights, refused unless it names ids of the target's vocabulary."""
    vocab_map = state.pop("vocab_map", None)
    if vocab_map is None or vocab_map.ndim != 1 or len(vocab_map) == 0:
        raise DraftlabError(f"{what} {path} lacks its vocab_map; rebuild it")
    if int(vocab_map.min()) < 0 or int(vocab_map.max()) >= vocab_size:
        raise DraftlabError(f"{what} {path} maps to token ids beyond {target_name}'s vocabulary")
    return vocab_map


@dataclass(frozen=True)
class LayerDraftFormat:
    """A one-layer draft's file format (the feature draft, EAGLE-3): what `save_layer_draft` and `load_layer_draft`
    need to know of it. Its drafts have `layer` (with a `shape` dataclass), `vocab_map`, `target_vocab_size`, `made`."""

    format: str  # the record's "format"
    words: str  # the draft in words, for errors ("feature draft")
    shape: Callable[..., Any]  # the shape dataclass, built from the record's "shape"
    expected: Callable[[Any, Any], Any]  # (target config, saved shape) -> the shape this target asks for
    layer: Callable[[Any], nn.Module]  # shape -> an untrained layer
    assemble: Callable[[Any, nn.Module, torch.Tensor], Any]  # (target, layer, vocab_map [V']) -> the draft


def save_layer_draft(draft, out: str | Path, target_name: str, kind: LayerDraftFormat, dtype: torch.dtype) -> Path:
    """Write a one-layer draft's own weights (in `dtype`) and the record of how it was made, atomically."""
    shape = {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(draft.layer.shape).items()}
    record = {"format": kind.format, "version": 1, "target": target_name, "target_vocab_size": draft.target_vocab_size,
              "shape": shape, "vocab_size": len(draft.vocab_map), "made": draft.made}
    return write_draft_files(out, own_weights(draft.layer, draft.vocab_map, dtype), record)


def load_layer_draft(path: str | Path, target, kind: LayerDraftFormat):
    """Rebuild a saved one-layer draft on top of `target` (whose embeddings, head and hidden states it reads)."""
    record, state = read_draft_files(path, kind.format)
    check_target_vocab(path, record, target.vocab_size, target.name)
    try:
        shape = kind.shape(**record["shape"])
    except (KeyError, TypeError, ValueError) as exc:
        raise DraftlabError(f"{kind.words} {path} has no valid shape in its record; rebuild it") from exc
    if shape != kind.expected(target.model.config, shape):
        raise DraftlabError(f"{kind.words} {path} was made for a target of another shape, not {target.name}")
    vocab_map = take_vocab_map(path, state, target.vocab_size, target.name, kind.words)
    layer = kind.layer(shape)
    load_strict(layer, {k: v.to(target.dtype) for k, v in state.items()}, path)
    layer.to(target.dtype).eval().requires_grad_(False)
    draft = kind.assemble(target, layer, vocab_map)
    draft.made = record.get("made", {})
    return draft
