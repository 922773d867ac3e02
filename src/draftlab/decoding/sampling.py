"""Turn logits into the distribution we sample from, and sample it.

The same warping (temperature, top-k, min-p, top-p) is applied to draft and target
logits, so that speculative sampling is lossless with respect to the warped
target distribution, exactly what plain sampling from the target would use.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from draftlab.errors import DraftlabError


@dataclass(frozen=True)
class SamplingConfig:
    """How the next token is chosen. temperature == 0 means greedy."""

    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off
    min_p: float = 0.0  # 0: off; else tokens under min_p times the likeliest token's probability are dropped

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise DraftlabError(f"temperature must be >= 0 (0 is greedy) and finite, got {self.temperature}")
        if self.top_k < 0:
            raise DraftlabError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:  # NaN fails this too
            raise DraftlabError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise DraftlabError(f"min_p must be in [0, 1], got {self.min_p}")

    @property
    def greedy(self) -> bool:
        """True when decoding takes the argmax."""
        return self.temperature == 0.0


def logits_to_probs(logits: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """Warped probabilities for each row of logits: [n, V] -> [n, V]."""
    scaled = logits / max(config.temperature, 1e-5)
    if config.top_k > 0:
        kth = torch.topk(scaled, min(config.top_k, scaled.shape[-1]), dim=-1).values[..., -1:]  # [n, 1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)  # [n, V]
    if config.min_p > 0.0:  # vLLM's min-p: relative to each row's likeliest token
        probs = probs.masked_fill(probs < config.min_p * probs.max(dim=-1, keepdim=True).values, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    if config.top_p < 1.0:
        probs = _top_p_filter(probs, config.top_p)
    return probs


def _top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True)  # [n, V]
    # Keep a token if the mass strictly before it is below top_p (the first is always kept).
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
    kept = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return kept / kept.sum(dim=-1, keepdim=True)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """Draw one token id from a probability vector [V]."""
    return int(torch.multinomial(probs, 1, generator=generator).item())


def choose(logits: torch.Tensor, config: SamplingConfig, generator: torch.Generator | None) -> tuple[int, torch.Tensor | None]:
    """Next token from one row of logits [V]; returns (token, probs or None when greedy)."""
    if config.greedy:
        return int(logits.argmax().item()), None
    probs = logits_to_probs(logits.unsqueeze(0), config)[0]  # [V]
    return sample(probs, generator), probs
