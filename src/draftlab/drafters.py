"""Draft sources behind one protocol.

A `Drafter` proposes up to k tokens that continue the committed context. It does
not choose k (a `DraftLengthPolicy` does) and does not verify (the verifier
does). Drafters that sample return the probabilities they sampled from, so that
rejection sampling stays exact; drafters that look tokens up return None and
are verified as one-hot drafts.

- `ModelDrafter`: any causal LM with the target's tokenizer, behind a Backend.
- `build_layer_draft`: a self-draft made of a subset of the target's layers, as
  a new module that shares the target's weights (the target is not touched).
- `NGramDrafter`: prompt lookup; copies what followed the latest earlier
  occurrence of the context's last n tokens.
- `FeatureDrafter` (feature_draft.py): an EAGLE-style draft that reads the
  target's hidden states.
- `NoDrafter`: proposes nothing, which turns the engine into plain
  autoregressive decoding through the same code path (the baseline).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from draftlab.backend import Backend
from draftlab.errors import DraftlabError
from draftlab.models import LoadedModel
from draftlab.sampling import SamplingConfig, choose


@dataclass(frozen=True)
class Proposal:
    """Drafted tokens and, when the drafter sampled them, its distributions."""

    tokens: list[int]  # [k]
    draft_probs: torch.Tensor | None = None  # [k, V]; None: no distribution (one-hot)

    def __len__(self) -> int:
        return len(self.tokens)


class Drafter(Protocol):
    """Anything that proposes draft tokens for the engine.

    A drafter that also reads the target's hidden states (a feature draft) sets
    `reads_target_hidden = True` and has `observe(target_hidden [n, D])`, which the
    engine calls with the rows of each newly committed and cached token.
    """

    name: str

    def begin(self, prompt_ids: Sequence[int]) -> None:
        """Forget the previous sequence; a new generation starts from `prompt_ids`."""
        ...

    def propose(
        self, context: Sequence[int], k: int, sampling: SamplingConfig, generator: torch.Generator | None
    ) -> Proposal:
        """Up to k tokens that continue `context` (every committed token)."""
        ...


class NoDrafter:
    """Proposes nothing: the engine then decodes autoregressively."""

    name = "none"

    def begin(self, prompt_ids: Sequence[int]) -> None:
        """Nothing to reset."""

    def propose(self, context, k, sampling, generator) -> Proposal:
        """An empty proposal."""
        return Proposal([])


class NGramDrafter:
    """Prompt lookup: match the last n tokens (n from max_n down to min_n) earlier in the context."""

    def __init__(self, max_n: int = 3, min_n: int = 1) -> None:
        if not 1 <= min_n <= max_n:
            raise DraftlabError(f"n-gram sizes need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.max_n, self.min_n = max_n, min_n
        self.name = f"ngram:{min_n}-{max_n}"

    def begin(self, prompt_ids: Sequence[int]) -> None:
        """Stateless: the context is searched afresh each step."""

    def propose(self, context, k, sampling, generator) -> Proposal:
        """The k tokens that followed the latest earlier occurrence of the longest matching suffix."""
        tokens = np.asarray(context, dtype=np.int64)  # [L]
        for n in range(self.max_n, self.min_n - 1, -1):
            if len(tokens) <= n:
                continue
            windows = sliding_window_view(tokens[:-1], n)  # [L-n, n]; each has a continuation
            hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return Proposal(tokens[start : start + k].tolist())
        return Proposal([])


class ModelDrafter:
    """A small causal LM that drafts autoregressively, with its own rolled-back cache.

    Cache invariant: `self._fed` lists exactly the tokens in the draft cache.
    Committed tokens never change, so only the part after the previous context
    can disagree with the new one; that part is rolled back and re-fed.
    """

    def __init__(self, backend: Backend, name: str = "model", vocab_map: torch.Tensor | None = None,
                 target_vocab_size: int | None = None) -> None:
        """vocab_map [V']: target token id of each draft output row, for drafts with a cut vocabulary."""
        if vocab_map is not None and target_vocab_size is None:
            raise DraftlabError("a draft with a vocabulary map needs the target's vocabulary size")
        self.backend = backend
        self.name = name
        self.vocab_map = vocab_map
        self.target_vocab_size = target_vocab_size
        self._fed: list[int] = []
        self._stable = 0  # prefix of _fed known to be committed

    def begin(self, prompt_ids: Sequence[int]) -> None:
        """Drop the cache; the next proposal prefills the prompt."""
        self.backend.reset()
        self._fed, self._stable = [], 0

    def propose(self, context, k, sampling, generator) -> Proposal:
        """Draft k tokens one at a time; probabilities [k, V] when sampling."""
        logits = self._catch_up(context)  # [V]
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        for i in range(k):
            token, token_probs = self._choose(logits, sampling, generator)
            tokens.append(token)
            if token_probs is not None:
                probs.append(token_probs)
            if i + 1 < k:
                logits = self.backend.score([token], last_only=True)[-1]
                self._fed.append(token)
        self._stable = len(context)
        return Proposal(tokens, torch.stack(probs) if probs else None)

    def _choose(self, logits, sampling, generator) -> tuple[int, torch.Tensor | None]:
        """Pick a token from the draft's logits [V'] and express it (and its probabilities) in target ids."""
        token, token_probs = choose(logits, sampling, generator)
        if self.vocab_map is None:
            return token, token_probs
        if token_probs is not None:
            full = torch.zeros(self.target_vocab_size, dtype=token_probs.dtype)  # [V]
            token_probs = full.index_copy_(0, self.vocab_map, token_probs)
        return int(self.vocab_map[token]), token_probs

    def _catch_up(self, context: Sequence[int]) -> torch.Tensor:
        """Roll back to the longest common prefix with `context`, feed the rest; logits [V] after it."""
        common = self._stable
        limit = min(len(self._fed), len(context))
        while common < limit and self._fed[common] == context[common]:
            common += 1
        common = min(common, len(context) - 1)  # always feed at least one token to get logits
        self.backend.rollback(common)
        del self._fed[common:]
        missing = list(context[common:])
        self._fed.extend(missing)
        return self.backend.score(missing, last_only=True)[-1]


def check_compatible(target: LoadedModel, draft: LoadedModel) -> None:
    """Raise unless draft and target share tokenizer and vocabulary size."""
    if target.vocab_size != draft.vocab_size:
        raise DraftlabError(
            f"draft {draft.name} has {draft.vocab_size} output tokens but target {target.name} has "
            f"{target.vocab_size}; speculative decoding needs the same vocabulary"
        )
    if target.tokenizer.get_vocab() != draft.tokenizer.get_vocab():
        raise DraftlabError(
            f"draft {draft.name} and target {target.name} use different tokenizers; choose a draft from the same family"
        )


def build_layer_draft(target: LoadedModel, layers: Sequence[int]) -> LoadedModel:
    """A new model made of `layers` of the target (plus its embeddings, norm and head), sharing weights."""
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
    draft_model = AutoModelForCausalLM.from_config(draft_config, dtype=target.dtype)
    draft_model.load_state_dict(_layer_state(target.model.state_dict(), layers), assign=True, strict=True)
    draft_model.to(target.device).eval()
    draft_model.requires_grad_(False)
    name = f"{target.name}:layers{format_layers(layers)}"
    return LoadedModel(name, draft_model, target.tokenizer, target.device, target.dtype)


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
