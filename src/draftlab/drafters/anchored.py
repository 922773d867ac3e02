"""Drafters anchored on the target's hidden states: feature drafts (EAGLE-1 style) and EAGLE-3 drafts.

Both are one decoder layer that reads, at position i, features of the target's
position i and the embedding of the token x_{i+1} chosen after it, and
predicts what follows x_{i+1}; to draft further they feed their own output
back in place of the target's features. They differ in what they read
(`AnchoredDraft.taps`: the final hidden state, or the inputs of three target
layers that `lift` fuses) and in what they feed back (predicted final features,
or the layer's own pre-norm output). `AnchoredDrafter` runs either: it keeps
the draft's KV cache in step with the committed tokens, re-anchored on real
target features after every verification, and drafts chains and trees.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch
import torch.nn.functional as F

from draftlab.backends.numerics import causal_mask, scatter_vocab
from draftlab.drafters.base import DraftAsk, PerRequest, draft_chain, propose_each
from draftlab.errors import DraftlabError
from draftlab.decoding.sampling import SamplingConfig, choose
from draftlab.decoding.step import Proposal, tree_layout


class KVCache:
    """Batch-1 key/value buffers [1, Hkv, capacity, hd], rolled back by length."""

    def __init__(self, num_kv_heads: int, head_dim: int, capacity: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        size = (1, num_kv_heads, capacity, head_dim)
        self.keys = torch.zeros(size, dtype=dtype, device=device)
        self.values = torch.zeros(size, dtype=dtype, device=device)
        self.length = 0

    def append(self, key: torch.Tensor, value: torch.Tensor, visible: torch.Tensor | None = None):
        """Store [1, Hkv, n, hd] after the cached entries; all keys, values and the mask (`visible`, else causal)."""
        n = key.shape[2]
        start, end = self.length, self.length + n
        if end > self.keys.shape[2]:
            raise DraftlabError(f"draft cache holds {self.keys.shape[2]} positions; {end} needed")
        self.keys[:, :, start:end] = key
        self.values[:, :, start:end] = value
        self.length = end
        mask = causal_mask(start, n, key.device) if visible is None else visible.to(key.device)
        return self.keys[:, :, :end], self.values[:, :, :end], mask


class RowCaches:
    """The caches of several runs as one batch for one new row each: each row appended to its run's cache, then every
    run's keys and values attended as a padded batch (each row sees its own cache only)."""

    def __init__(self, caches: list[KVCache]) -> None:
        self.caches = caches

    def append(self, key: torch.Tensor, value: torch.Tensor, visible: torch.Tensor | None = None):
        """Store row b of key and value [B, Hkv, 1, hd] in cache b; keys and values [B, Hkv, L, hd] padded to the
        longest cache, and the mask [B, 1, 1, L] of each run's own entries."""
        for b, cache in enumerate(self.caches):
            cache.append(key[b:b + 1], value[b:b + 1])
        lengths = torch.tensor([cache.length for cache in self.caches])  # [B]
        longest = int(lengths.max())
        keys = key.new_zeros(key.shape[0], key.shape[1], longest, key.shape[3])  # [B, Hkv, L, hd]
        values = torch.zeros_like(keys)
        for b, cache in enumerate(self.caches):
            keys[b, :, :cache.length] = cache.keys[0, :, :cache.length]
            values[b, :, :cache.length] = cache.values[0, :, :cache.length]
        mask = torch.arange(longest)[None] < lengths[:, None]  # [B, L]
        return keys, values, mask[:, None, None].to(key.device)


class AnchoredDraft(Protocol):
    """A one-layer draft reading the target's hidden states (`feature.FeatureDraft`, `eagle3.Eagle3Draft`)."""

    layer: torch.nn.Module  # (inputs, embeddings, cos, sin, cache) -> outputs [B, T, D]
    embed: torch.Tensor  # [V, D] the target's input embeddings
    cos: torch.Tensor  # [P, hd] rotary tables
    sin: torch.Tensor

    vocab_map: torch.Tensor  # [V'] target token id of each draft logit row
    taps: tuple[int, ...]  # target layers whose inputs it reads, concatenated; (): the final hidden states
    target_vocab_size: int

    def new_cache(self, capacity: int | None = None) -> KVCache:
        """An empty KV cache for its layer (default capacity: the target's context length)."""
        ...

    def lift(self, real: torch.Tensor) -> torch.Tensor:
        """The layer's input [..., D] from real target hidden states [..., D_taps] (in the draft's dtype)."""
        ...

    def predict(self, features: torch.Tensor, next_ids: torch.Tensor, start: int = 0,
                cache: KVCache | None = None) -> torch.Tensor:
        """Outputs [B, T, D] for pairs (inputs [B, T, D], next token ids [B, T]) at positions from `start`."""
        ...

    def predict_tree(self, features: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor,
                     cache: KVCache, visible: torch.Tensor) -> torch.Tensor:
        """Outputs [1, T, D] for tree pairs at `positions` [T], appended to `cache`, seeing `visible`."""
        ...

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """Draft logits [..., V'] from outputs [..., D]."""
        ...


class AnchoredDrafter(PerRequest):
    """Drafts with an `AnchoredDraft`, re-anchored on the target's hidden states after every step.

    State: `_features` holds real target features not yet fed to the draft
    cache; the cache holds `_anchored` pairs built from real features, plus
    the speculative pairs of the last proposal (rolled back before the next).
    Invariant, as in the engine: real features exist for every committed token
    but the newest, so pair i = (f_i, x_{i+1}) exists for i < len(context) - 1.
    """

    reads_target_hidden = True
    max_depth = None  # trees of any depth

    def __init__(self, draft: AnchoredDraft, name: str) -> None:
        self.draft = draft
        self.name = name
        self.target_taps = draft.taps
        self._cache: KVCache | None = None
        self._features: list[torch.Tensor] = []  # real target hidden states [n, D_taps] not yet in the cache
        self._anchored = 0
        self._tip: torch.Tensor | None = None  # [1, D] the prediction after the newest pair in the cache
        self._prompt: list[int] | None = None  # the prompt while its states are still coming in
        self._last = torch.empty(0)  # [1, D] the newest predicted features while drafting

    def begin(self, prompt_ids: Sequence[int]) -> None:
        """Drop the cache and any pending features; the prompt's pairs are taken in as its states arrive."""
        self._cache = self.draft.new_cache()
        self._features, self._anchored, self._tip = [], 0, None
        self._prompt = list(prompt_ids)

    def beside(self, seq: int) -> "AnchoredDrafter":
        """The same draft for one more sequence in flight (`draftlab serve`): its own cache and features, the weights
        shared."""
        return AnchoredDrafter(self.draft, self.name)

    def finish(self, context: Sequence[int]) -> None:
        """The generation ended: its cache and features go (a served slot holds nothing between requests)."""
        self._cache, self._features, self._anchored, self._tip, self._prompt = None, [], 0, None, None

    def held_positions(self) -> int:
        """Positions its cache holds now (0 once its generation ended)."""
        return 0 if self._cache is None else self._cache.length

    def observe(self, target_hidden: torch.Tensor) -> None:
        """Take the target's hidden states [n, D_taps] of the next n committed tokens (in order). The prompt's are fed
        to the draft's cache at once, as the target prefills it (chunk by chunk where it prefills in chunks), so that
        the first step drafts at a step's own cost."""
        if target_hidden.shape[0]:
            self._features.append(target_hidden)
        pending = sum(part.shape[0] for part in self._features)
        if self._prompt is not None and self._anchored + pending <= len(self._prompt) - 1:
            self._anchor(self._prompt[:self._anchored + pending + 1])
        if self._prompt is not None and self._anchored >= len(self._prompt) - 1:
            self._prompt = None  # what follows are the states of generated tokens

    @torch.inference_mode()
    def propose(self, context, k, sampling: SamplingConfig, generator) -> Proposal:
        """Up to k tokens; their draft probabilities [k, V] when sampling."""
        features = self._anchor(context)  # [n, D] predicted features; the last follows the newest token
        if features is None:
            return Proposal([])
        self._last = features[-1:]  # [1, D]
        pick = lambda logits: self._choose(logits, sampling, generator)  # noqa: E731
        return draft_chain(self.draft.logits(self._last[-1]), k, pick, self._advance)

    @torch.inference_mode()
    def propose_all(self, asks: Sequence[DraftAsk]) -> list[Proposal]:
        """Every run's chain (each ask's drafter is this one or `beside` it): each anchored on its own new features,
        then each draft position of all runs in one forward of the layer and one product of the head."""
        drafters = {i: ask.drafter for i, ask in enumerate(asks) if ask.k > 0}
        if len(drafters) < 2:  # a run alone drafts as `propose` does, on its own cache
            return propose_each(asks)
        anchored = {i: drafter._anchor(asks[i].context) for i, drafter in drafters.items()}  # [n, D] or None
        ready = [i for i in drafters if anchored[i] is not None]
        tokens: dict[int, list[int]] = {i: [] for i in ready}
        probs: dict[int, list[torch.Tensor]] = {i: [] for i in ready}
        features = torch.stack([anchored[i][-1] for i in ready]) if ready else None  # [B, D]
        while ready:
            logits = self.draft.logits(features)  # [B, V']
            for row, i in enumerate(ready):
                token, token_probs = self._choose(logits[row], asks[i].sampling, asks[i].generator)
                tokens[i].append(token)
                if token_probs is not None:
                    probs[i].append(token_probs)
            going = [row for row, i in enumerate(ready) if len(tokens[i]) < asks[i].k]
            ready = [ready[row] for row in going]
            if ready:
                features = self._advance_rows([drafters[i] for i in ready], features[going],
                                              [tokens[i][-1] for i in ready])
        return [Proposal(tokens[i], None, torch.stack(probs[i]) if probs[i] else None) if i in tokens  # [k, V]
                else Proposal([]) for i in range(len(asks))]

    def _advance_rows(self, drafters: list["AnchoredDrafter"], features: torch.Tensor, chosen: list[int]
                      ) -> torch.Tensor:
        """Feed each run's (last predicted features [B, D], drafted token) as a speculative pair, all in one forward;
        the next predicted features [B, D]."""
        caches = [drafter._cache for drafter in drafters]
        ids = torch.tensor(chosen, device=features.device)[:, None]  # [B, 1]
        positions = torch.tensor([cache.length for cache in caches], device=features.device)  # [B]
        embeds = F.embedding(ids, self.draft.embed).to(features.dtype)  # [B, 1, D]
        cos, sin = self.draft.cos[positions][:, None, None], self.draft.sin[positions][:, None, None]  # [B, 1, 1, hd]
        return self.draft.layer(features[:, None], embeds, cos, sin, RowCaches(caches))[:, 0]  # [B, D]

    @property
    def vocab_map(self) -> torch.Tensor:
        """[V'] target token id of each draft logit row."""
        return self.draft.vocab_map

    @torch.inference_mode()
    def root_logits(self, context: Sequence[int]) -> torch.Tensor | None:
        """Tree drafting: anchor on the newest real features; draft logits [V'] after `context`, or None."""
        features = self._anchor(context)  # [n, D]
        if features is None:
            return None
        self._root = features[-1]  # [D]
        self._tree_slots: dict[int, int] = {}  # tree node -> cache slot
        self._tree_features: dict[int, torch.Tensor] = {}  # tree node -> its predicted features [D]
        return self.draft.logits(self._root)

    @torch.inference_mode()
    def tree_logits(self, tokens: list[int], parents: tuple[int, ...], rows: list[int]) -> torch.Tensor:
        """Tree drafting: feed the pairs of nodes `rows` (each after its parent's predicted features).

        Each row goes into the draft cache at position anchored + depth and sees
        the anchored pairs, its ancestors' pairs and its own; logits [len(rows), V'].
        """
        layout = tree_layout(tuple(parents))
        start = self._cache.length
        for offset, row in enumerate(rows):
            self._tree_slots[row] = start + offset
        features = torch.stack([self._tree_features.get(parents[r], self._root) for r in rows])[None]  # [1, T, D]
        ids = torch.tensor([[tokens[r] for r in rows]], device=features.device)  # [1, T]
        positions = (self._anchored + layout.depths[rows]).to(features.device)  # [T]
        visible = torch.zeros(len(rows), start + len(rows), dtype=torch.bool)  # [T, cached + T]
        visible[:, : self._anchored] = True
        for i, row in enumerate(rows):
            seen = layout.ancestors[row].nonzero()[:, 0].tolist()  # the row and its ancestors
            visible[i, [self._tree_slots[j] for j in seen]] = True
        predicted = self.draft.predict_tree(features, ids, positions, self._cache, visible)[0]  # [T, D]
        for i, row in enumerate(rows):
            self._tree_features[row] = predicted[i]
        return self.draft.logits(predicted)

    def reanchor(self, features: torch.Tensor) -> None:
        """Forget the draft cache: the next proposal feeds these real features [n, D_taps] (every committed token's but
        the newest) again, with the draft's weights as they are now (after an online update, `drafters/adapt.py`)."""
        self._cache.length = self._anchored = 0
        self._features, self._tip, self._prompt = [features], None, None

    def _advance(self, token: int) -> torch.Tensor:
        """Feed (last predicted features, drafted token) as a speculative pair; draft logits [V'] after it."""
        ids = torch.tensor([[token]], device=self._last.device)
        self._last = self.draft.predict(self._last[None], ids, self._cache.length, self._cache)[0]  # [1, D]
        return self.draft.logits(self._last[-1])

    def _anchor(self, context: Sequence[int]) -> torch.Tensor | None:
        """Roll back speculative pairs, feed the pairs of newly real features; [n, D] predictions or None."""
        self._cache.length = self._anchored
        if not self._features:
            return self._tip  # [1, D] after the newest pair taken in already (the prompt's), or None
        real = torch.cat(self._features)  # [n, D]
        self._features = []
        start = self._anchored
        if start + real.shape[0] != len(context) - 1:
            raise DraftlabError("feature drafter lost track of the target's hidden states")
        ids = torch.tensor([list(context[start + 1 :])], device=real.device)  # [1, n]
        predicted = self.draft.predict(self.draft.lift(real[None]), ids, start, self._cache)[0]  # [n, D]
        self._anchored = self._cache.length
        self._tip = predicted[-1:]  # [1, D]
        return predicted

    def _choose(self, logits: torch.Tensor, sampling, generator) -> tuple[int, torch.Tensor | None]:
        """A token from the cut-vocabulary logits [V'], with probabilities over the full vocabulary [V]."""
        token, token_probs = choose(logits.float(), sampling, generator)
        if token_probs is not None:
            token_probs = scatter_vocab(token_probs, self.draft.vocab_map, self.draft.target_vocab_size)  # [V]
        return int(self.draft.vocab_map[token]), token_probs


class FeatureDrafter(AnchoredDrafter):
    """An `AnchoredDrafter` running a feature draft, which online adaptation can train."""

    learns_as = "feature"  # online adaptation trains it as a feature draft (`adapt.LEARNERS`)

    def __init__(self, draft, name: str = "feature") -> None:
        super().__init__(draft, name)
