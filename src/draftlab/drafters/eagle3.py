"""EAGLE-3 drafts: one decoder layer that fuses a low, a middle and a high hidden state of the target.

At position i the target's inputs of three of its layers (`aux_layers`, by
default [2, L/2, L-3], the layers vLLM, SGLang and llama.cpp read) are
concatenated and projected by `fc` to the draft's input g_i; the layer reads
(g_i, embedding of x_{i+1}) and returns h_i, whose normed form the head turns
into the distribution of x_{i+2}:

    g_i    = fc([a_i ; b_i ; c_i])                                     [D] from [3 D_t]
    h_i    = layer(concat(input_norm(embed(x_{i+1})), hidden_norm(g_i)), residual g_i)
    logits = head_rows @ out_norm(h_i)                                 [V'] the draft vocabulary

To draft further the layer feeds its own pre-norm output back: (h_i, x_hat_{i+2})
at position i+1 (EAGLE-3's "training-time test" teaches it to, see
`draftlab.design.eagle3`). The layout and names are those of the EAGLE-3
checkpoints the engines load (`draftlab.drafters.eagle3_checkpoint` writes them):
q/k/v read 2D inputs, `hidden_norm` normalises g, the residual is the raw g.

The head is the target's LM head cut to the draft vocabulary's rows (kept
frozen, as in the feature draft), so the draft's own weights are fc, the layer
and its norms: 4.2M parameters (8.4 MB in bf16) for SmolLM2-135M with an MLP of
1024 channels. Saved as a draft directory (`drafters/files.py`):

    draftlab_draft.json   {"format": "draftlab-eagle3-draft", "version": 1, "target": ..., "shape": {...},
                           "vocab_size": V', "made": {...}}
    weights.safetensors   fc.weight, the layer's tensors, out_norm, vocab_map [V']
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from draftlab.backends.numerics import rms_norm, rope
from draftlab.drafters.anchored import KVCache
from draftlab.drafters.files import LayerDraftFormat, draft_format, load_layer_draft, save_layer_draft, target_parts
from draftlab.errors import DraftlabError
from draftlab.models import LoadedModel

FORMAT = "draftlab-eagle3-draft"
EAGLE3_MODEL_TYPES = ("llama", "qwen2")


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """The three target layers EAGLE-3 reads when its config names none: [2, L/2, L-3] (vLLM, llama.cpp)."""
    return (2, num_layers // 2, num_layers - 3)


@dataclass(frozen=True)
class Eagle3Shape:
    """The draft layer's shape (the target's hidden size and heads, its own MLP width) and what it reads."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    target_hidden_size: int
    aux_layers: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "aux_layers", tuple(int(i) for i in self.aux_layers))
        if len(self.aux_layers) != 3:
            raise DraftlabError(f"an EAGLE-3 draft reads exactly 3 target layers, not {list(self.aux_layers)}")

    @classmethod
    def of(cls, config, intermediate_size: int | None = None,
           aux_layers: tuple[int, ...] | None = None) -> "Eagle3Shape":
        """The shape for a Llama-family target (Llama, Qwen2); the draft layer itself is a Llama layer."""
        if getattr(config, "model_type", None) not in EAGLE3_MODEL_TYPES:
            raise DraftlabError(f"EAGLE-3 drafts support targets of types {EAGLE3_MODEL_TYPES}, "
                                f"not {getattr(config, 'model_type', None)!r}")
        layers = config.num_hidden_layers
        aux = tuple(aux_layers) if aux_layers else default_aux_layers(layers)
        if any(not 0 <= i < layers for i in aux):
            raise DraftlabError(f"EAGLE-3 aux layers {list(aux)} must lie in 0..{layers - 1}")
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(config.hidden_size, config.num_attention_heads, config.num_key_value_heads, head_dim,
                   intermediate_size or config.intermediate_size, config.rms_norm_eps, config.hidden_size, aux)


class Eagle3Layer(nn.Module):
    """fc + the EAGLE-3 decoder layer + output norm, with the engines' tensor roles."""

    def __init__(self, shape: Eagle3Shape) -> None:
        super().__init__()
        d, hd = shape.hidden_size, shape.head_dim
        self.shape = shape
        self.fc = nn.Linear(3 * shape.target_hidden_size, d, bias=False)
        self.input_norm = nn.Parameter(torch.ones(d))  # on the token embeddings
        self.hidden_norm = nn.Parameter(torch.ones(d))  # on g (fused target features, or its own output)
        self.q_proj = nn.Linear(2 * d, shape.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(2 * d, shape.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(2 * d, shape.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(shape.num_heads * hd, d, bias=False)
        self.post_norm = nn.Parameter(torch.ones(d))
        self.gate_proj = nn.Linear(d, shape.intermediate_size, bias=False)
        self.up_proj = nn.Linear(d, shape.intermediate_size, bias=False)
        self.down_proj = nn.Linear(shape.intermediate_size, d, bias=False)
        self.out_norm = nn.Parameter(torch.ones(d))

    def attention_inputs(self, g: torch.Tensor, embeds: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Query [B, H, T, hd], key and value [B, Hkv, T, hd] for inputs g and embeddings [B, T, D]."""
        s = self.shape
        eps = s.rms_norm_eps
        joined = torch.cat([rms_norm(embeds, self.input_norm, eps), rms_norm(g, self.hidden_norm, eps)], -1)  # [B,T,2D]
        b, t, _ = joined.shape
        query = self.q_proj(joined).view(b, t, s.num_heads, s.head_dim).transpose(1, 2)
        key = self.k_proj(joined).view(b, t, s.num_kv_heads, s.head_dim).transpose(1, 2)
        value = self.v_proj(joined).view(b, t, s.num_kv_heads, s.head_dim).transpose(1, 2)
        return rope(query, cos, sin), rope(key, cos, sin), value

    def finish(self, g: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """The layer's pre-norm output [B, T, D] from its input g [B, T, D] and attention output [B, H, T, hd]."""
        b, t, _ = g.shape
        hidden = g + self.o_proj(attended.transpose(1, 2).reshape(b, t, -1))  # [B, T, D]
        normed = rms_norm(hidden, self.post_norm, self.shape.rms_norm_eps)
        return hidden + self.down_proj(F.silu(self.gate_proj(normed)) * self.up_proj(normed))

    def forward(self, g: torch.Tensor, embeds: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: KVCache | None = None, visible: torch.Tensor | None = None) -> torch.Tensor:
        """Pre-norm outputs [B, T, D]: causal among the T positions without a cache; with one, appended to it and
        attending to everything cached before them, or, given `visible` [T, cached + T], to exactly what it marks."""
        query, key, value = self.attention_inputs(g, embeds, cos, sin)
        if cache is None:
            out = F.scaled_dot_product_attention(query, key, value, is_causal=True, enable_gqa=True)
        else:
            key, value, mask = cache.append(key, value, visible)
            out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, enable_gqa=True)
        return self.finish(g, out)


@dataclass
class Eagle3Draft:
    """An EAGLE-3 layer plus the target parts it reads: embeddings, head rows, rotary tables."""

    layer: Eagle3Layer
    embed: torch.Tensor  # [V, D] the target's input embeddings (shared, frozen)
    head: torch.Tensor  # [V', D] the target's LM-head rows of the draft vocabulary (frozen)
    vocab_map: torch.Tensor  # [V'] target token id of each head row (ascending)
    cos: torch.Tensor  # [P, hd]
    sin: torch.Tensor  # [P, hd]
    made: dict = field(default_factory=dict)

    @property
    def taps(self) -> tuple[int, ...]:
        """The target layers whose inputs it reads."""
        return self.layer.shape.aux_layers

    @property
    def target_vocab_size(self) -> int:
        return int(self.embed.shape[0])

    def new_cache(self, capacity: int | None = None) -> KVCache:
        """An empty KV cache for the layer (default capacity: the target's context length)."""
        shape = self.layer.shape
        return KVCache(shape.num_kv_heads, shape.head_dim, capacity or self.cos.shape[0], self.head.dtype,
                       self.head.device)

    def lift(self, real: torch.Tensor) -> torch.Tensor:
        """g [..., D] from the target layers' inputs [..., 3 D_t]: the fc projection."""
        return self.layer.fc(real.to(self.layer.fc.weight.dtype))

    def predict(self, g: torch.Tensor, next_ids: torch.Tensor, start: int = 0,
                cache: KVCache | None = None) -> torch.Tensor:
        """Pre-norm outputs [B, T, D] for pairs (g [B, T, D], next token ids [B, T]) at positions from `start`."""
        t = next_ids.shape[-1]
        embeds = F.embedding(next_ids, self.embed).to(g.dtype)
        return self.layer(g, embeds, self.cos[start : start + t], self.sin[start : start + t], cache)

    def predict_tree(self, g: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                     visible: torch.Tensor) -> torch.Tensor:
        """Pre-norm outputs [1, T, D] for tree pairs at `positions` [T], appended to `cache`, seeing `visible`."""
        embeds = F.embedding(next_ids, self.embed).to(g.dtype)
        return self.layer(g, embeds, self.cos[positions], self.sin[positions], cache, visible)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft logits [..., V'] from pre-norm outputs [..., D]."""
        normed = rms_norm(hidden, self.layer.out_norm, self.layer.shape.rms_norm_eps)
        return F.linear(normed, self.head.to(normed.dtype))


def new_eagle3_draft(target: LoadedModel, vocab_map: torch.Tensor, intermediate_size: int | None = None,
                     aux_layers: tuple[int, ...] | None = None, init_from_target: bool = True) -> Eagle3Draft:
    """An EAGLE-3 draft for `target`; its layer starts from the target's last layer (MLP cut to its strongest
    `intermediate_size` channels), fc from the identity on the highest tap, unless `init_from_target` is False."""
    config = target.model.config
    shape = Eagle3Shape.of(config, intermediate_size, aux_layers)
    layer = Eagle3Layer(shape).to(target.dtype)
    if init_from_target:
        _copy_target_layer(layer, target.model.model.layers[-1], target.model.model.norm.weight)
    return _assemble(target, layer, torch.sort(vocab_map.long()).values)


def _copy_target_layer(layer: Eagle3Layer, source: nn.Module, final_norm: torch.Tensor) -> None:
    """g starts as the highest tap; both halves of q/k/v as the target layer's, its MLP's strongest channels."""
    d = layer.shape.hidden_size
    with torch.no_grad():
        fc = torch.zeros_like(layer.fc.weight)
        fc[:, 2 * d :] = torch.eye(d, dtype=fc.dtype)
        layer.fc.weight.copy_(fc)
        for norm in (layer.input_norm, layer.hidden_norm):
            norm.copy_(source.input_layernorm.weight)
        layer.post_norm.copy_(source.post_attention_layernorm.weight)
        layer.out_norm.copy_(final_norm)
        for name in ("q_proj", "k_proj", "v_proj"):
            weight = getattr(source.self_attn, name).weight  # [out, D]
            getattr(layer, name).weight.copy_(torch.cat([weight, weight], dim=1) / 2)
        layer.o_proj.weight.copy_(source.self_attn.o_proj.weight)
        mlp = source.mlp
        strength = mlp.down_proj.weight.float().norm(dim=0) * mlp.up_proj.weight.float().norm(dim=1)  # [I]
        keep = strength.topk(layer.shape.intermediate_size).indices.sort().values
        layer.gate_proj.weight.copy_(mlp.gate_proj.weight[keep])
        layer.up_proj.weight.copy_(mlp.up_proj.weight[keep])
        layer.down_proj.weight.copy_(mlp.down_proj.weight[:, keep])


def _assemble(target: LoadedModel, layer: Eagle3Layer, vocab_map: torch.Tensor) -> Eagle3Draft:
    """Attach the target's embeddings, head rows and rotary tables to an EAGLE-3 layer."""
    embed, head, cos, sin = target_parts(target, vocab_map)
    layer.to(target.device)
    return Eagle3Draft(layer, embed, head, vocab_map.long(), cos, sin)


EAGLE3_FILES = LayerDraftFormat(FORMAT, "EAGLE-3 draft", Eagle3Shape,
                                lambda config, saved: Eagle3Shape.of(config, saved.intermediate_size, saved.aux_layers),
                                Eagle3Layer, _assemble)


def save_eagle3_draft(draft: Eagle3Draft, out: str | Path, target_name: str,
                      dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write the draft's own weights (in `dtype`) and the record of how it was made, atomically."""
    return save_layer_draft(draft, out, target_name, EAGLE3_FILES, dtype)


def is_eagle3_draft(path: str | Path) -> bool:
    """True for a directory written by `save_eagle3_draft`."""
    return draft_format(path) == FORMAT


def load_eagle3_draft(path: str | Path, target: LoadedModel) -> Eagle3Draft:
    """Rebuild a saved EAGLE-3 draft on top of `target` (whose embeddings, head and hidden states it reads)."""
    return load_layer_draft(path, target, EAGLE3_FILES)
