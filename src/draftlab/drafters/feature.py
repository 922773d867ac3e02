"""Feature drafts: a one-layer draft that reads the target's hidden states (as EAGLE does).

A small draft cut from the target agrees with it on few tokens, because a
few layers cannot redo what thirty did. A feature draft does not try: at
position i it sees the target's own last hidden state f_i (the vector the
target's LM head turns into the distribution of token i+1) and the embedding
of the token x_{i+1} that was actually chosen, and it predicts f_{i+1}, from
which the target's LM head (cut to the frequent rows) reads token i+2:

    f_hat_{i+1} = layer(fc([f_i ; embed(x_{i+1})]))        one Llama decoder layer
    draft_logits = head_rows @ norm(f_hat_{i+1})           [V'] rows of the target's head

To draft further it feeds its own prediction back: (f_hat_{i+1}, x_hat_{i+2}).
The target's hidden states arrive with each verification (the engine passes
the rows of the committed tokens to `FeatureDrafter.observe`), so the draft is
re-anchored on real features every step.

The draft's own weights are the fc, the layer and its norms (~4M parameters
for SmolLM2, a few MB in bf16): the input embeddings and the head rows are
the target's, shared at load time. Its layer starts as a copy of the
target's last layer (pruning), then `draftlab design feature` trains it.

Saved as a draft directory (`drafters/files.py`; the record names this format):

    draftlab_draft.json   {"format": "draftlab-feature-draft", "version": 1, "target": ..., "shape": {...},
                           "vocab_size": V', "made": {...}}
    weights.safetensors   fc.weight, layer.*, out_norm.weight, vocab_map [V']
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

FORMAT = "draftlab-feature-draft"


@dataclass(frozen=True)
class FeatureShape:
    """The draft layer's shape: the target's, so that its last layer can initialise it."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    attention_bias: bool = False  # q/k/v projections with biases (Qwen2)

    @classmethod
    def of(cls, config) -> "FeatureShape":
        """The shape of a Llama-family target's layers (Llama, Qwen2)."""
        model_type = getattr(config, "model_type", None)
        if model_type not in FEATURE_MODEL_TYPES:
            raise DraftlabError(f"feature drafts support model types {FEATURE_MODEL_TYPES}, not {model_type!r}")
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        bias = model_type == "qwen2" or bool(getattr(config, "attention_bias", False))
        return cls(config.hidden_size, config.num_attention_heads, config.num_key_value_heads, head_dim,
                   config.intermediate_size, config.rms_norm_eps, bias)


FEATURE_MODEL_TYPES = ("llama", "qwen2")  # qwen2: Llama with q/k/v biases


class FeatureLayer(nn.Module):
    """fc + one Llama decoder layer + output norm; reads (feature, next-token embedding) pairs."""

    def __init__(self, shape: FeatureShape) -> None:
        super().__init__()
        d, hd = shape.hidden_size, shape.head_dim
        self.shape = shape
        self.fc = nn.Linear(2 * d, d, bias=False)
        self.input_norm = nn.Parameter(torch.ones(d))
        self.q_proj = nn.Linear(d, shape.num_heads * hd, bias=shape.attention_bias)
        self.k_proj = nn.Linear(d, shape.num_kv_heads * hd, bias=shape.attention_bias)
        self.v_proj = nn.Linear(d, shape.num_kv_heads * hd, bias=shape.attention_bias)
        self.o_proj = nn.Linear(shape.num_heads * hd, d, bias=False)
        self.post_norm = nn.Parameter(torch.ones(d))
        self.gate_proj = nn.Linear(d, shape.intermediate_size, bias=False)
        self.up_proj = nn.Linear(d, shape.intermediate_size, bias=False)
        self.down_proj = nn.Linear(shape.intermediate_size, d, bias=False)
        self.out_norm = nn.Parameter(torch.ones(d))

    def forward(self, features: torch.Tensor, embeds: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: KVCache | None = None, visible: torch.Tensor | None = None) -> torch.Tensor:
        """Predicted next features [B, T, D] (normed) from features and embeddings [B, T, D].

        Without a cache the T positions attend causally among themselves (training);
        with one, they are appended to it and attend to everything cached before them,
        or, given `visible` [T, cached + T] (a draft tree's mask), to exactly what it marks.
        """
        s = self.shape
        hidden = self.fc(torch.cat([features, embeds], dim=-1))  # [B, T, D]
        normed = rms_norm(hidden, self.input_norm, s.rms_norm_eps)
        b, t, _ = hidden.shape
        query = self.q_proj(normed).view(b, t, s.num_heads, s.head_dim).transpose(1, 2)  # [B, H, T, hd]
        key = self.k_proj(normed).view(b, t, s.num_kv_heads, s.head_dim).transpose(1, 2)  # [B, Hkv, T, hd]
        value = self.v_proj(normed).view(b, t, s.num_kv_heads, s.head_dim).transpose(1, 2)
        query, key = rope(query, cos, sin), rope(key, cos, sin)
        if cache is None:
            out = F.scaled_dot_product_attention(query, key, value, is_causal=True, enable_gqa=True)
        else:
            key, value, mask = cache.append(key, value, visible)
            out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, enable_gqa=True)
        hidden = hidden + self.o_proj(out.transpose(1, 2).reshape(b, t, -1))  # [B, T, D]
        normed = rms_norm(hidden, self.post_norm, s.rms_norm_eps)
        hidden = hidden + self.down_proj(F.silu(self.gate_proj(normed)) * self.up_proj(normed))
        return rms_norm(hidden, self.out_norm, s.rms_norm_eps)


@dataclass
class FeatureDraft:
    """A feature layer plus the target parts it reads: embeddings, head rows, rotary tables."""

    layer: FeatureLayer
    embed: torch.Tensor  # [V, D] the target's input embeddings (shared, frozen)
    head: torch.Tensor  # [V', D] the target's LM-head rows of the draft vocabulary (frozen)
    vocab_map: torch.Tensor  # [V'] target token id of each head row
    cos: torch.Tensor  # [P, hd]
    sin: torch.Tensor  # [P, hd]
    made: dict = field(default_factory=dict)
    taps = ()  # it reads the target's final hidden states

    @property
    def target_vocab_size(self) -> int:
        return int(self.embed.shape[0])

    def new_cache(self, capacity: int | None = None) -> KVCache:
        """An empty KV cache for the layer (default capacity: the target's context length)."""
        shape = self.layer.shape
        return KVCache(shape.num_kv_heads, shape.head_dim, capacity or self.cos.shape[0], self.head.dtype,
                       self.head.device)

    def lift(self, real: torch.Tensor) -> torch.Tensor:
        """The target's final hidden states [..., D] are the layer's input as they are (in the draft's dtype)."""
        return real.to(self.head.dtype)

    def predict(self, features: torch.Tensor, next_ids: torch.Tensor, start: int = 0,
                cache: KVCache | None = None) -> torch.Tensor:
        """Predicted features [B, T, D] for pairs (features [B, T, D], next token ids [B, T]) from `start`."""
        t = next_ids.shape[-1]
        embeds = F.embedding(next_ids, self.embed).to(features.dtype)
        return self.layer(features, embeds, self.cos[start : start + t], self.sin[start : start + t], cache)

    def predict_tree(self, features: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor,
                     cache: KVCache, visible: torch.Tensor) -> torch.Tensor:
        """Predicted features [1, T, D] for tree pairs at `positions` [T], appended to `cache`, seeing `visible`."""
        embeds = F.embedding(next_ids, self.embed).to(features.dtype)
        return self.layer(features, embeds, self.cos[positions], self.sin[positions], cache, visible)

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """Draft logits over the cut vocabulary [..., V'] from (predicted or real) features [..., D]."""
        return F.linear(features, self.head.to(features.dtype))


def feature_loss(draft: FeatureDraft, features: torch.Tensor, tokens: torch.Tensor, noise: float,
                 generator: torch.Generator, regression_weight: float = 1.0) -> torch.Tensor:
    """EAGLE's two terms on real target features [B, T, D] (fp32) and their tokens [B, T] (token t at feature t).

    The draft sees (f_t + uniform noise of width `noise`, x_{t+1}) and is scored on the target's distribution at
    t+1 (the head rows applied to the real f_{t+1}: cross-entropy) and on f_{t+1} itself (smooth L1). The one loss
    of offline training (`draftlab.design.feature`) and online adaptation (`draftlab.drafters.adapt`)."""
    jitter = (torch.rand(features[:, :-1].shape, generator=generator) - 0.5) * noise
    predicted = draft.predict(features[:, :-1] + jitter.to(features.device), tokens[:, 1:])  # [B, T-1, D]
    target_next = features[:, 1:]  # [B, T-1, D]
    with torch.no_grad():
        target_probs = torch.softmax(draft.logits(target_next), dim=-1)  # [B, T-1, V']
    log_draft = torch.log_softmax(draft.logits(predicted), dim=-1)  # [B, T-1, V']
    classification = -(target_probs * log_draft).sum(-1).mean()
    regression = F.smooth_l1_loss(predicted, target_next)
    return classification + regression_weight * regression


def new_feature_draft(target: LoadedModel, vocab_map: torch.Tensor, init_layer: int | None = -1) -> FeatureDraft:
    """A feature draft for `target` whose layer copies the target's layer `init_layer` (None: random)."""
    shape = FeatureShape.of(target.model.config)
    layer = FeatureLayer(shape).to(target.dtype)
    if init_layer is not None:
        _copy_target_layer(layer, target.model.model.layers[init_layer], target.model.model.norm.weight)
    return _assemble(target, layer, vocab_map)


def _copy_target_layer(layer: FeatureLayer, source: nn.Module, final_norm: torch.Tensor) -> None:
    """Initialise from a target layer; fc starts as f + embed (the residual stream's own sum)."""
    d = layer.shape.hidden_size
    with torch.no_grad():
        eye = torch.eye(d, dtype=layer.fc.weight.dtype)
        layer.fc.weight.copy_(torch.cat([eye, eye], dim=1))
        layer.input_norm.copy_(source.input_layernorm.weight)
        layer.post_norm.copy_(source.post_attention_layernorm.weight)
        layer.out_norm.copy_(final_norm)
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            mine, theirs = getattr(layer, name), getattr(source.self_attn, name)
            mine.weight.copy_(theirs.weight)
            if mine.bias is not None:
                mine.bias.copy_(theirs.bias)
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(layer, name).weight.copy_(getattr(source.mlp, name).weight)


def _assemble(target: LoadedModel, layer: FeatureLayer, vocab_map: torch.Tensor) -> FeatureDraft:
    """Attach the target's embeddings, head rows and rotary tables to a feature layer."""
    embed, head, cos, sin = target_parts(target, vocab_map)
    layer.to(target.device)
    return FeatureDraft(layer, embed, head, vocab_map.long(), cos, sin)


FEATURE_FILES = LayerDraftFormat(FORMAT, "feature draft", FeatureShape, lambda config, _: FeatureShape.of(config),
                                 FeatureLayer, _assemble)


def save_feature_draft(draft: FeatureDraft, out: str | Path, target_name: str,
                       dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write the draft's own weights (in `dtype`) and the record of how it was made."""
    return save_layer_draft(draft, out, target_name, FEATURE_FILES, dtype)


def is_feature_draft(path: str | Path) -> bool:
    """True for a directory written by `save_feature_draft`."""
    return draft_format(path) == FORMAT


def load_feature_draft(path: str | Path, target: LoadedModel) -> FeatureDraft:
    """Rebuild a saved feature draft on top of `target` (whose embeddings and head it reads)."""
    return load_layer_draft(path, target, FEATURE_FILES)
