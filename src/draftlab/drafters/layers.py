"""A self-draft made of a subset of the target's layers, as a new module that shares the target's weights."""

from __future__ import annotations

import copy
from typing import Sequence

import torch

from draftlab.errors import DraftlabError
from draftlab.models import LoadedModel, dtype_suffix


def build_layer_draft(target: LoadedModel, layers: Sequence[int], dtype: torch.dtype | None = None) -> LoadedModel:
    """A new model made of `layers` of the target (plus its embeddings, norm and head).

    It shares the target's weights when `dtype` is None or the target's; in another dtype it holds converted copies.
    """
    dtype = dtype or target.dtype
    config = target.model.config
    total = config.num_hidden_layers
    layers = list(layers)
    if not layers or any(not 0 <= i < total for i in layers) or len(set(layers)) != len(layers):
        raise DraftlabError(f"layer indices must be distinct and in 0..{total - 1}, got {layers}")
    from transformers import AutoModelForCausalLM

    draft_config = copy.deepcopy(config)  # never mutate the loaded model's config
    draft_config.num_hidden_layers = len(layers)
    if getattr(config, "layer_types", None) is not None:
        draft_config.layer_types = [config.layer_types[i] for i in layers]
    draft_model = AutoModelForCausalLM.from_config(draft_config, dtype=dtype)
    state = _layer_state(target.model.state_dict(), layers)
    state = {key: tensor.to(dtype) if tensor.is_floating_point() else tensor for key, tensor in state.items()}
    draft_model.load_state_dict(state, assign=True, strict=True)
    draft_model.to(target.device).eval()
    draft_model.requires_grad_(False)
    name = f"{target.name}:layers{format_layers(layers)}{dtype_suffix(dtype, target.dtype)}"
    return LoadedModel(name, draft_model, target.tokenizer, target.device, dtype)


def _layer_state(state: dict[str, torch.Tensor], layers: list[int]) -> dict[str, torch.Tensor]:
    """The target's state dict with layer i renamed to its position in `layers`."""
    new_index = {old: new for new, old in enumerate(layers)}
    out = {}
    for key, tensor in state.items():
        parts = key.split(".")
        if "layers" in parts:
            at = parts.index("layers") + 1
            old = int(parts[at])
            if old not in new_index:
                continue
            parts[at] = str(new_index[old])
        out[".".join(parts)] = tensor
    return out


def format_layers(layers: Sequence[int]) -> str:
    """Compact text for a layer list: [0,1,2,3] -> '0-3', [0,2,4] -> '0,2,4'."""
    layers = list(layers)
    if len(layers) > 1 and layers == list(range(layers[0], layers[-1] + 1)):
        return f"{layers[0]}-{layers[-1]}"
    return ",".join(map(str, layers))
