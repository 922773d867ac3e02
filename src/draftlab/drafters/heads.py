"""Decoder heads (Medusa-style): extra heads on the target's last hidden state draft several tokens at once.

The target's own LM head reads token i+1 from its final hidden state f_i.
Head k (k = 1..H) reads token i+1+k from the same vector, through one
residual block and the target's head rows (cut to the frequent tokens):

    h_k = f_i + SiLU(W_k f_i + b_k)                  [D]   (Medusa-1's ResBlock)
    draft_logits_k = head_rows @ h_k                 [V']

With W_k = b_k = 0 a head repeats the target's next-token guess; training
(`draftlab design heads`) teaches it the token k places further. Drafting
needs no draft pass at all: the newest real feature (the engine passes the
target's hidden states of every committed and cached token to `observe`)
gives all H distributions in one product of H rows, so a chain of K <= H
tokens costs one small matrix product, and a tree (`tree:SHAPE:model:DIR`)
costs nothing more: the children of every node at depth d come from head
d + 1. The heads do not see the tokens drafted before them, so they accept
less than a draft that does (the feature draft), for far less drafting time.

Lossless as every drafter is: each drafted token is drawn from (or, greedy,
is the top of) the distribution it carries; the verifier needs nothing more.

Saved as a draft directory (`drafters/files.py`):

    draftlab_draft.json   {"format": "draftlab-heads-draft", "version": 1, "target": ...,
                           "target_vocab_size": V, "heads": H, "hidden_size": D, "vocab_size": V', "made": {...}}
    weights.safetensors   weight [H, D, D], bias [H, D], vocab_map [V']
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from draftlab.backends.numerics import scatter_vocab
from draftlab.drafters.base import PerRequest
from draftlab.drafters.files import (check_target_vocab, draft_format, load_strict, own_weights, read_draft_files,
                                     write_draft_files)
from draftlab.errors import DraftlabError
from draftlab.models import LoadedModel
from draftlab.decoding.sampling import SamplingConfig, choose
from draftlab.decoding.step import Proposal, node_depths

FORMAT = "draftlab-heads-draft"


class ResidualHeads(nn.Module):
    """H residual blocks on a shared input: h_k = f + SiLU(W_k f + b_k)."""

    def __init__(self, count: int, hidden_size: int) -> None:
        super().__init__()
        if count < 1:
            raise DraftlabError(f"a heads draft needs at least one head, got {count}")
        self.weight = nn.Parameter(torch.zeros(count, hidden_size, hidden_size))  # [H, D, D]
        self.bias = nn.Parameter(torch.zeros(count, hidden_size))  # [H, D]

    @property
    def count(self) -> int:
        return int(self.weight.shape[0])

    def forward(self, features: torch.Tensor, first: int = 0, count: int | None = None) -> torch.Tensor:
        """Head outputs [..., n, D] of heads first..first+n-1 for features [..., D]."""
        weight = self.weight[first : first + count if count else None]  # [n, D, D]
        bias = self.bias[first : first + count if count else None]  # [n, D]
        mixed = torch.einsum("...d,ned->...ne", features, weight) + bias  # [..., n, D]
        return features.unsqueeze(-2) + F.silu(mixed)


@dataclass
class HeadsDraft:
    """Decoder heads plus the target's head rows they read through."""

    heads: ResidualHeads
    head: torch.Tensor  # [V', D] the target's LM-head rows of the draft vocabulary (frozen)
    vocab_map: torch.Tensor  # [V'] target token id of each head row
    target_vocab_size: int
    made: dict = field(default_factory=dict)

    def logits(self, features: torch.Tensor, first: int = 0, count: int | None = None) -> torch.Tensor:
        """Draft logits [..., n, V'] of heads first..first+n-1 (head k drafts token i+1+k) from features [..., D]."""
        outputs = self.heads(features.to(self.head.dtype), first, count)  # [..., n, D]
        return F.linear(outputs, self.head)


def heads_loss(draft: HeadsDraft, features: torch.Tensor, decay: float) -> torch.Tensor:
    """Medusa's loss on real target features [B, T, D] (fp32): head k's cross-entropy against the target's
    distribution k places ahead (its head rows on f_{t+k}), weighted decay ** (k - 1). The one loss of offline
    training (`draftlab.design.heads`) and online adaptation (`draftlab.drafters.adapt`)."""
    with torch.no_grad():
        target_probs = torch.softmax(F.linear(features, draft.head.float()), -1)  # [B, T, V']
    logits = draft.logits(features)  # [B, T, H, V']
    total = torch.zeros(())
    for k in range(1, draft.heads.count + 1):
        log_draft = torch.log_softmax(logits[:, :-k, k - 1].float(), dim=-1)  # [B, T-k, V']
        total = total - decay ** (k - 1) * (target_probs[:, k:] * log_draft).sum(-1).mean()
    return total


def new_heads_draft(target: LoadedModel, vocab_map: torch.Tensor, count: int) -> HeadsDraft:
    """`count` untrained heads (each repeats the target's next-token guess) for `target`."""
    hidden_size = target.model.get_output_embeddings().weight.shape[1]
    heads = ResidualHeads(count, hidden_size).to(target.dtype)
    return _assemble(target, heads, vocab_map)


def _assemble(target: LoadedModel, heads: ResidualHeads, vocab_map: torch.Tensor) -> HeadsDraft:
    with torch.no_grad():
        head = target.model.get_output_embeddings().weight.detach()[vocab_map.to(target.device)]  # [V', D]
    heads.to(target.device)
    return HeadsDraft(heads, head, vocab_map.long(), target.vocab_size)


def save_heads_draft(draft: HeadsDraft, out: str | Path, target_name: str,
                     dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write the heads' weights (in `dtype`) and the record of how they were made."""
    record = {"format": FORMAT, "version": 1, "target": target_name, "target_vocab_size": draft.target_vocab_size,
              "heads": draft.heads.count, "hidden_size": int(draft.head.shape[1]),
              "vocab_size": len(draft.vocab_map), "made": draft.made}
    return write_draft_files(out, own_weights(draft.heads, draft.vocab_map, dtype), record)


def is_heads_draft(path: str | Path) -> bool:
    """True for a directory written by `save_heads_draft`."""
    return draft_format(path) == FORMAT


def load_heads_draft(path: str | Path, target: LoadedModel) -> HeadsDraft:
    """Rebuild saved heads on top of `target` (whose head rows they read)."""
    record, state = read_draft_files(path, FORMAT)
    check_target_vocab(path, record, target.vocab_size, target.name)
    hidden_size = target.model.get_output_embeddings().weight.shape[1]
    if record.get("hidden_size") != hidden_size or not isinstance(record.get("heads"), int):
        raise DraftlabError(f"heads draft {path} was made for a target of another shape, not {target.name}")
    if "vocab_map" not in state:
        raise DraftlabError(f"heads draft {path} lacks its vocab_map; rebuild it")
    vocab_map = state.pop("vocab_map")
    if int(vocab_map.max()) >= target.vocab_size:
        raise DraftlabError(f"heads draft {path} maps to token ids beyond {target.name}'s vocabulary")
    heads = ResidualHeads(record["heads"], hidden_size)
    load_strict(heads, {k: v.to(target.dtype) for k, v in state.items()}, path)
    heads.to(target.dtype).eval().requires_grad_(False)
    draft = _assemble(target, heads, vocab_map)
    draft.made = record.get("made", {})
    return draft


class HeadsDrafter(PerRequest):
    """Drafts up to H tokens (a chain or a tree) from the newest real target feature.

    Invariant, as in the engine: real features exist for every committed token
    but the newest, so the newest feature f_{n-2} (n = len(context)) gives the
    target's guess of the newest token, and head k the token k places after it.
    """

    reads_target_hidden = True
    learns_as = "heads"  # online adaptation trains it as decoder heads (`adapt.LEARNERS`)

    def __init__(self, draft: HeadsDraft, name: str = "heads") -> None:
        self.draft = draft
        self.name = name
        self.max_depth = draft.heads.count  # trees and chains draft at most one token per head
        self._newest = torch.empty(0)  # [D] the newest real feature
        self._seen = 0  # real features received since `begin`
        self._levels = torch.empty(0)  # [H, V'] draft logits of each head (trees)

    def beside(self, seq: int) -> "HeadsDrafter":
        """The same heads for one more sequence in flight (`draftlab serve` on torch): its own newest feature."""
        return HeadsDrafter(self.draft, self.name)

    def begin(self, prompt_ids: Sequence[int]) -> None:
        """Forget the previous sequence."""
        self._newest, self._seen = torch.empty(0), 0

    def observe(self, target_hidden: torch.Tensor) -> None:
        """Keep the newest of the target's hidden states [n, D]."""
        if target_hidden.shape[0]:
            self._newest = target_hidden[-1]
            self._seen += target_hidden.shape[0]

    @property
    def vocab_map(self) -> torch.Tensor:
        """[V'] target token id of each draft logit row."""
        return self.draft.vocab_map

    @torch.inference_mode()
    def propose(self, context, k, sampling: SamplingConfig, generator) -> Proposal:
        """Up to min(k, H) tokens, one per head; their draft probabilities [k, V] when sampling."""
        logits = self._head_logits(context, min(k, self.max_depth))  # [k, V']
        if logits is None:
            return Proposal([])
        tokens, rows = [], []
        for head_logits in logits:
            token, token_probs = choose(head_logits.float(), sampling, generator)
            tokens.append(int(self.draft.vocab_map[token]))
            if token_probs is not None:
                rows.append(scatter_vocab(token_probs, self.draft.vocab_map, self.draft.target_vocab_size))  # [V]
        return Proposal(tokens, None, torch.stack(rows) if rows else None)  # draft_probs [k, V]

    @torch.inference_mode()
    def root_logits(self, context: Sequence[int]) -> torch.Tensor | None:
        """Tree drafting: every head's logits at once; the first head's [V'] (None before any feature)."""
        logits = self._head_logits(context, self.max_depth)  # [H, V']
        if logits is None:
            return None
        self._levels = logits
        return logits[0]

    def tree_logits(self, tokens: list[int], parents: tuple[int, ...], rows: list[int]) -> torch.Tensor:
        """Tree drafting: the children of a node at depth d come from head d + 1, whatever the path; [len(rows), V']."""
        depths = node_depths(parents)  # 1 for the root's children
        if max(depths[r] for r in rows) >= self.max_depth:
            raise DraftlabError(f"{self.name} has {self.max_depth} heads; a tree cannot be deeper")
        return self._levels[[depths[r] for r in rows]]

    def _head_logits(self, context: Sequence[int], count: int) -> torch.Tensor | None:
        """Logits [count, V'] of heads 1..count from the newest real feature; None before the first."""
        if self._seen == 0 or count < 1:
            return None
        if self._seen != len(context) - 1:
            raise DraftlabError("heads drafter lost track of the target's hidden states")
        return self.draft.logits(self._newest, 0, count)
