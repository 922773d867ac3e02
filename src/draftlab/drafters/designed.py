"""Designed layer drafts (pruned from the target), and the file format that ships them.

The draft directory holds only the draft's own weights (its layers, final
norm, LM-head rows and the map from its output rows to target token ids);
the input embeddings are shared with the target at load time:

    draftlab_draft.json   {"format": "draftlab-draft", "version": 1, "target": ..., "target_vocab_size": V,
                           "layers": [...], "vocab_size": V' or null, "made": {how it was made}}
    weights.safetensors   layers.{i}.*, norm.weight, lm_head.weight [V', D], vocab_map [V']

`draftlab design prune` and `design distill` make them; the registry loads
them as `model:DIR`.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from draftlab.drafters.files import RECORD, WEIGHTS, check_target_vocab, draft_format, load_strict, read_draft_files
from draftlab.errors import DraftlabError
from draftlab.models import LoadedModel

FORMAT = "draftlab-draft"


@dataclass
class DesignedDraft:
    """A draft module (sharing the target's embeddings) and the map from its outputs to target ids."""

    model: LoadedModel
    layers: list[int]
    vocab_map: torch.Tensor | None  # [V'] target token ids; None: the full vocabulary
    made: dict = field(default_factory=dict)


def is_draft_dir(path: str | Path) -> bool:
    """True for a directory written by `save_draft`."""
    return draft_format(path) == FORMAT


def build_draft(target: LoadedModel, layers: Sequence[int], vocab_map: torch.Tensor | None = None,
                state: dict[str, torch.Tensor] | None = None, origin: str = "(built in memory)") -> DesignedDraft:
    """A new module: the target's embeddings (shared), `layers` (the target's, or from `state`), a (cut) head."""
    from transformers import AutoModelForCausalLM

    layers = list(layers)
    config = target.model.config
    if not layers or any(not 0 <= i < config.num_hidden_layers for i in layers):
        raise DraftlabError(f"layer indices must be in 0..{config.num_hidden_layers - 1}, got {layers}")
    draft_config = copy.deepcopy(config)  # the target's config is never modified
    draft_config.num_hidden_layers = len(layers)
    draft_config.tie_word_embeddings = False
    if getattr(config, "layer_types", None) is not None:
        draft_config.layer_types = [config.layer_types[i] for i in layers]
    model = AutoModelForCausalLM.from_config(draft_config, dtype=target.dtype)
    source = state if state is not None else _initial_state(target, layers, vocab_map)
    head = source["lm_head.weight"]
    model.lm_head = torch.nn.Linear(head.shape[1], head.shape[0], bias=False, dtype=target.dtype)
    own = {k: v for k, v in source.items() if k != "vocab_map"}
    own["model.embed_tokens.weight"] = target.model.model.embed_tokens.weight.detach()
    load_strict(model, _as_model_keys(own), origin, assign=True)
    model.to(target.device).eval()
    name = f"{target.name}:draft[{','.join(map(str, layers))}]" + (f"/v{len(vocab_map)}" if vocab_map is not None else "")
    loaded = LoadedModel(name, model, target.tokenizer, target.device, target.dtype)
    return DesignedDraft(loaded, layers, vocab_map)


def _initial_state(target: LoadedModel, layers: list[int], vocab_map: torch.Tensor | None) -> dict:
    """Weights copied from the target: the chosen layers, the final norm, the (cut) head."""
    state = target.model.state_dict()
    out = {}
    for new, old in enumerate(layers):
        prefix = f"model.layers.{old}."
        for key, tensor in state.items():
            if key.startswith(prefix):
                out[f"layers.{new}.{key[len(prefix):]}"] = tensor.detach().clone()
    out["norm.weight"] = state["model.norm.weight"].detach().clone()
    head = target.model.get_output_embeddings().weight.detach()
    out["lm_head.weight"] = (head[vocab_map] if vocab_map is not None else head).clone()
    return out


def _as_model_keys(own: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Draft-file keys (layers.0.x, norm.weight, lm_head.weight) -> HF module keys."""
    out = {}
    for key, tensor in own.items():
        if key.startswith("layers.") or key == "norm.weight":
            out["model." + key] = tensor
        else:
            out[key] = tensor
    return out


def draft_state(draft: DesignedDraft) -> dict[str, torch.Tensor]:
    """The draft's own weights (no embeddings), in the file's key names."""
    out = {}
    for key, tensor in draft.model.model.state_dict().items():
        if key.startswith("model.layers.") or key == "model.norm.weight":
            out[key.removeprefix("model.")] = tensor.detach().contiguous()
        elif key == "lm_head.weight":
            out[key] = tensor.detach().contiguous()
    if draft.vocab_map is not None:
        out["vocab_map"] = draft.vocab_map.contiguous()
    return out


def save_draft(draft: DesignedDraft, out: str | Path, target_name: str, dtype: torch.dtype | None = None) -> Path:
    """Write the draft's own weights and the record of how it was made."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state = draft_state(draft)
    if dtype is not None:
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    save_file(state, str(out / WEIGHTS))
    record = {"format": FORMAT, "version": 1, "target": target_name,
              "target_vocab_size": int(draft.model.model.model.embed_tokens.weight.shape[0]), "layers": draft.layers,
              "vocab_size": None if draft.vocab_map is None else len(draft.vocab_map), "made": draft.made}
    (out / RECORD).write_text(json.dumps(record, indent=2))
    return out


def load_draft(path: str | Path, target: LoadedModel) -> DesignedDraft:
    """Rebuild a saved draft on top of `target` (whose embeddings it shares)."""
    record, state = read_draft_files(path, FORMAT)
    check_target_vocab(path, record, target.vocab_size, target.name)
    if "lm_head.weight" not in state or "layers" not in record:
        raise DraftlabError(f"draft {path} lacks its head or layer list; rebuild the draft")
    if state["lm_head.weight"].shape[1] != target.model.config.hidden_size:
        raise DraftlabError(f"draft {path} was made for a target of another width, not {target.name}")
    vocab_map = state.get("vocab_map")
    state = {k: v.to(target.dtype) if v.is_floating_point() else v for k, v in state.items()}
    draft = build_draft(target, record["layers"], vocab_map, state, str(path))
    draft.made = record.get("made", {})
    return draft


