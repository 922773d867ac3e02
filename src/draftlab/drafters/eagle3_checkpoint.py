"""EAGLE-3 drafts in the engines' checkpoint format, which vLLM, SGLang and llama.cpp's converter load.

The checkpoint is the `LlamaForCausalLMEagle3` layout of the EAGLE-3 authors'
releases, which vLLM (`method: "eagle3"`), SGLang (`--speculative-algorithm
EAGLE3`) and llama.cpp's `convert_hf_to_gguf.py` all read:

    config.json         architectures ["LlamaForCausalLMEagle3"], a one-layer Llama config with the target's
                        vocab_size, draft_vocab_size, target_hidden_size, eagle_aux_hidden_state_layer_ids
    model.safetensors   fc.weight [D, 3 D_t]; midlayer.{input_layernorm, hidden_norm, post_attention_layernorm,
                        self_attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj}.weight; norm.weight;
                        lm_head.weight [V', D]; d2t [V'] (target id - draft id); t2d [V] (bool)

`read_checkpoint` loads such a checkpoint (written here, or by the engines'
trainers: `midlayer.` or speculators' `layers.0.` names) as a draft for the
torch backend (`--drafter model:DIR`). GGUF: `draftlab.design.eagle3_gguf`.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

from draftlab.drafters.eagle3 import (
    Eagle3Draft, Eagle3Layer, Eagle3Shape, _assemble, default_aux_layers, load_eagle3_draft,
)
from draftlab.drafters.files import RECORD, WEIGHTS as LAYER_WEIGHTS
from draftlab.errors import DraftlabError
from draftlab.files.assets import cache_dir, sha256_file
from draftlab.models import LoadedModel
from draftlab.files.safeio import write_atomic

ARCHITECTURE = "LlamaForCausalLMEagle3"
CONFIG, WEIGHTS = "config.json", "model.safetensors"
CHECKPOINT_DIR, GGUF = "eagle3-checkpoint", "eagle3-draft.gguf"  # a draft directory's files for the engines
# draftlab's layer tensors -> the checkpoint's names
NAMES = {
    "fc.weight": "fc.weight",
    "input_norm": "midlayer.input_layernorm.weight",
    "hidden_norm": "midlayer.hidden_norm.weight",
    "q_proj.weight": "midlayer.self_attn.q_proj.weight",
    "k_proj.weight": "midlayer.self_attn.k_proj.weight",
    "v_proj.weight": "midlayer.self_attn.v_proj.weight",
    "o_proj.weight": "midlayer.self_attn.o_proj.weight",
    "post_norm": "midlayer.post_attention_layernorm.weight",
    "gate_proj.weight": "midlayer.mlp.gate_proj.weight",
    "up_proj.weight": "midlayer.mlp.up_proj.weight",
    "down_proj.weight": "midlayer.mlp.down_proj.weight",
    "out_norm": "norm.weight",
}


def checkpoint_config(draft: Eagle3Draft, target: LoadedModel) -> dict:
    """The checkpoint's config.json for `draft` on `target`."""
    shape, config = draft.layer.shape, target.model.config
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": shape.rms_norm_eps,
        "vocab_size": draft.target_vocab_size,
        "draft_vocab_size": len(draft.vocab_map),
        "target_hidden_size": shape.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(shape.aux_layers),
        "max_position_embeddings": config.max_position_embeddings,
        "rope_theta": float(_rope_theta(config)),
        "rope_scaling": None,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "torch_dtype": "bfloat16",
    }


def _rope_theta(config) -> float:
    """The target's rotary base (transformers 5 keeps it in rope_parameters)."""
    parameters = getattr(config, "rope_parameters", None) or {}
    return parameters.get("rope_theta") or getattr(config, "rope_theta", 10000.0)


def checkpoint_tensors(draft: Eagle3Draft, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors: the layer's under the engines' names, the head rows, d2t and t2d."""
    state = draft.layer.state_dict()
    tensors = {NAMES[name]: state[name].detach().to(dtype).cpu().contiguous() for name in NAMES}
    vocab_map = draft.vocab_map.cpu().long()
    tensors["lm_head.weight"] = draft.head.detach().to(dtype).cpu().contiguous()
    tensors["d2t"] = vocab_map - torch.arange(len(vocab_map))
    t2d = torch.zeros(draft.target_vocab_size, dtype=torch.bool)
    t2d[vocab_map] = True
    tensors["t2d"] = t2d
    return tensors


def write_checkpoint(draft: Eagle3Draft, target: LoadedModel, out: str | Path) -> Path:
    """Write the engines' EAGLE-3 checkpoint of `draft` into directory `out`, atomically per file."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".{WEIGHTS}.{os.getpid()}.tmp"  # this writer's own: another process may write the same at once
    save_file(checkpoint_tensors(draft), str(tmp), metadata={"format": "pt"})
    tmp.replace(out / WEIGHTS)
    write_atomic(out / CONFIG, json.dumps(checkpoint_config(draft, target), indent=2))
    return out


def engine_files(directory: Path) -> tuple[Path, Path]:
    """(engines' checkpoint, llama.cpp's GGUF) of an EAGLE-3 draft directory (`draftlab design eagle3` writes both
    there); a checkpoint directory is its own checkpoint, with the GGUF beside it."""
    if is_checkpoint(directory):
        return directory, directory.parent / GGUF
    return directory / CHECKPOINT_DIR, directory / GGUF


def engines_checkpoint(directory: Path) -> Path:
    """Where an EAGLE-3 draft's engines' checkpoint lies: an engines' checkpoint is itself; a draft directory's is the
    one `draftlab design eagle3` wrote into it, else one in the cache, keyed by the draft's files
    (`ensure_engines_checkpoint` writes it)."""
    own = engine_files(directory)[0]
    if is_checkpoint(own):
        return own
    files = [directory / RECORD, directory / LAYER_WEIGHTS]
    if not all(f.is_file() for f in files):
        raise DraftlabError(f"{directory} is neither an EAGLE-3 checkpoint nor an EAGLE-3 draft of draftlab's "
                            f"(no {RECORD} and {LAYER_WEIGHTS})")
    digest = hashlib.sha256()
    for f in files:
        digest.update(sha256_file(f).encode())
    return cache_dir() / "eagle3-checkpoints" / digest.hexdigest()[:16]


def ensure_engines_checkpoint(directory: Path, target: LoadedModel) -> Path:
    """The engines' checkpoint of an EAGLE-3 draft (`engines_checkpoint`), written once from draftlab's draft
    directory where there is none yet (its config last: a checkpoint with a config is whole)."""
    path = engines_checkpoint(directory)
    if not is_checkpoint(path):
        write_checkpoint(load_eagle3_draft(directory, target), target, path)
    return path


def is_checkpoint(path: str | Path) -> bool:
    """True for a directory holding an EAGLE-3 checkpoint (a one-layer config with a draft vocabulary)."""
    config = Path(path) / CONFIG
    if not config.is_file():
        return False
    try:
        data = json.loads(config.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return isinstance(data, dict) and "draft_vocab_size" in data and data.get("num_hidden_layers") == 1


def read_checkpoint(path: str | Path, target: LoadedModel) -> Eagle3Draft:
    """An EAGLE-3 checkpoint (written here or by the engines' trainers, `midlayer.` or `layers.0.` names) as a draft
    on `target`: its own head and vocabulary map; refused with one line when it does not fit the target."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    if not is_checkpoint(path):
        raise DraftlabError(f"{path} holds no EAGLE-3 checkpoint (a {CONFIG} of one layer with a draft_vocab_size)")
    config = json.loads((path / CONFIG).read_text())
    try:
        shape = _shape(config, target)
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
        raise DraftlabError(f"EAGLE-3 checkpoint {path} has an incomplete {CONFIG} ({exc!r} missing or bad)") from exc
    if shape != Eagle3Shape.of(target.model.config, shape.intermediate_size, shape.aux_layers):
        raise DraftlabError(f"EAGLE-3 checkpoint {path} was made for a target of another shape, not {target.name}")
    if config.get("vocab_size") != target.vocab_size:
        raise DraftlabError(f"EAGLE-3 checkpoint {path} is for a {config.get('vocab_size')}-token vocabulary; "
                            f"{target.name} has {target.vocab_size}")
    try:
        state = {k.replace("layers.0.", "midlayer."): v for k, v in load_file(str(path / WEIGHTS)).items()}
    except (OSError, SafetensorError) as exc:
        raise DraftlabError(f"{path}/{WEIGHTS} cannot be read ({exc}); the file is damaged") from exc
    missing = [n for n in [*NAMES.values(), "lm_head.weight"] if n not in state]
    if missing:
        raise DraftlabError(f"EAGLE-3 checkpoint {path} lacks {missing[0]}")
    layer = Eagle3Layer(shape)
    layer.load_state_dict({mine: state[theirs] for mine, theirs in NAMES.items()}, strict=True)
    draft_vocab = config["draft_vocab_size"]
    vocab_map = state["d2t"].long() + torch.arange(draft_vocab) if "d2t" in state else torch.arange(draft_vocab)
    if int(vocab_map.min()) < 0 or int(vocab_map.max()) >= target.vocab_size:
        raise DraftlabError(f"EAGLE-3 checkpoint {path} maps to token ids beyond {target.name}'s vocabulary")
    layer.to(target.dtype).eval().requires_grad_(False)
    draft = _assemble(target, layer, vocab_map)
    draft.head = state["lm_head.weight"].to(target.dtype).to(target.device)
    return draft


def _shape(config: dict, target: LoadedModel) -> Eagle3Shape:
    """The draft layer's shape a checkpoint's config describes (aux layers default to [2, L/2, L-3])."""
    layers = target.model.config.num_hidden_layers
    aux = tuple(config.get("eagle_aux_hidden_state_layer_ids") or default_aux_layers(layers))
    heads = int(config["num_attention_heads"])
    return Eagle3Shape(int(config["hidden_size"]), heads, int(config["num_key_value_heads"]),
                       int(config.get("head_dim") or config["hidden_size"] // heads), int(config["intermediate_size"]),
                       float(config["rms_norm_eps"]),
                       int(config.get("target_hidden_size") or target.model.config.hidden_size), aux)
