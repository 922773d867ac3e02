"""Structured pruning: a draft cut from the target, and the file format that ships it.

A designed draft keeps a subset of the target's layers (chosen by hand, strided,
or searched greedily for the highest agreement with the target on calibration
text, in the spirit of self-speculative decoding's layer search) and,
optionally, only the most frequent tokens of the output vocabulary: the LM
head dominates a small draft's cost (SmolLM2: 49k x 576; Gemma 3 270M: 262k),
and a draft that can only propose frequent tokens loses little acceptance.

The draft directory holds only the draft's own weights (its layers, final
norm, LM-head rows and the map from its output rows to target token ids);
the input embeddings are shared with the target at load time:

    draftlab_draft.json   {"format": "draftlab-draft", "version": 1, "target": ..., "layers": [...],
                           "vocab_size": V' or null, "made": {how it was made}}
    weights.safetensors   layers.{i}.*, norm.weight, lm_head.weight [V', D], vocab_map [V']
"""

from __future__ import annotations

import copy
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from draftlab.errors import DraftlabError
from draftlab.models import LoadedModel

FORMAT = "draftlab-draft"
RECORD = "draftlab_draft.json"
WEIGHTS = "weights.safetensors"


@dataclass
class DesignedDraft:
    """A draft module (sharing the target's embeddings) and the map from its outputs to target ids."""

    model: LoadedModel
    layers: list[int]
    vocab_map: torch.Tensor | None  # [V'] target token ids; None: the full vocabulary
    made: dict = field(default_factory=dict)


def is_draft_dir(path: str | Path) -> bool:
    """True for a directory written by `save_draft`."""
    return (Path(path) / RECORD).is_file()


def frequent_tokens(sequences: Sequence[Sequence[int]], size: int, always: Sequence[int] = ()) -> torch.Tensor:
    """The `size` most frequent token ids in `sequences` (plus `always`), sorted: [V']."""
    counts = Counter(t for seq in sequences for t in seq)
    chosen = set(always)
    for token, _ in counts.most_common():
        if len(chosen) >= size:
            break
        chosen.add(token)
    return torch.tensor(sorted(chosen), dtype=torch.long)


def build_draft(target: LoadedModel, layers: Sequence[int], vocab_map: torch.Tensor | None = None,
                state: dict[str, torch.Tensor] | None = None) -> DesignedDraft:
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
    model.load_state_dict(_as_model_keys(own), assign=True, strict=True)
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
    record = {"format": FORMAT, "version": 1, "target": target_name, "layers": draft.layers,
              "vocab_size": None if draft.vocab_map is None else len(draft.vocab_map), "made": draft.made}
    (out / RECORD).write_text(json.dumps(record, indent=2))
    return out


def read_draft_files(path: str | Path, expected_format: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """The record and weights of a draft directory whose record has `expected_format`."""
    from safetensors.torch import load_file

    path = Path(path)
    try:
        record = json.loads((path / RECORD).read_text())
        state = load_file(str(path / WEIGHTS))
    except (OSError, json.JSONDecodeError) as exc:
        raise DraftlabError(f"{path} is not a readable draftlab draft ({exc})") from exc
    if record.get("format") != expected_format:
        raise DraftlabError(f"{path}/{RECORD} is not a {expected_format} record")
    return record, state


def load_draft(path: str | Path, target: LoadedModel) -> DesignedDraft:
    """Rebuild a saved draft on top of `target` (whose embeddings it shares)."""
    record, state = read_draft_files(path, FORMAT)
    if state["lm_head.weight"].shape[1] != target.model.config.hidden_size:
        raise DraftlabError(f"draft {path} was made for a target of another width, not {target.name}")
    vocab_map = state.get("vocab_map")
    state = {k: v.to(target.dtype) if v.is_floating_point() else v for k, v in state.items()}
    draft = build_draft(target, record["layers"], vocab_map, state)
    draft.made = record.get("made", {})
    return draft


@torch.inference_mode()
def agreement(target_next: torch.Tensor, draft: DesignedDraft, sequences: list[torch.Tensor]) -> float:
    """Teacher-forced top-1 agreement of the draft with the target's next tokens (~greedy acceptance)."""
    hits = total = 0
    offset = 0
    for tokens in sequences:
        logits = draft.model.model(input_ids=tokens[None]).logits[0]  # [n, V']
        predicted = logits.argmax(-1)
        if draft.vocab_map is not None:
            predicted = draft.vocab_map[predicted]
        expected = target_next[offset : offset + len(tokens)]
        hits += int((predicted == expected).sum())
        total += len(tokens)
        offset += len(tokens)
    return hits / total if total else 0.0


@torch.inference_mode()
def target_next_tokens(target: LoadedModel, sequences: list[torch.Tensor]) -> torch.Tensor:
    """The target's argmax next token at every position of every sequence, concatenated: [sum n]."""
    return torch.cat([target.model(input_ids=s[None]).logits[0].argmax(-1) for s in sequences])


def search_layers(target: LoadedModel, sequences: list[torch.Tensor], count: int,
                  vocab_map: torch.Tensor | None = None, progress: bool = True) -> tuple[list[int], float]:
    """Greedy forward selection of `count` layers maximising agreement with the target."""
    from tqdm import tqdm

    expected = target_next_tokens(target, sequences)
    chosen: list[int] = []
    best_score = 0.0
    total = target.model.config.num_hidden_layers
    bar = tqdm(total=sum(total - i for i in range(count)), desc="layer search", unit="draft", disable=not progress)
    for _ in range(count):
        scored = []
        for layer in range(total):
            if layer in chosen:
                continue
            candidate = sorted(chosen + [layer])
            scored.append((agreement(expected, build_draft(target, candidate, vocab_map), sequences), candidate))
            bar.update()
        best_score, chosen = max(scored, key=lambda item: item[0])
    bar.close()
    return chosen, best_score
