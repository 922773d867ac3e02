"""The interface between the engine and a model: prefill, score a block, roll back.

Cache invariant (the engine relies on it): a backend's cache holds exactly the
first `cache_len` tokens it was fed. `score(tokens)` appends `tokens` and
returns one row of logits per appended token; `rollback(n)` forgets everything
after the first n tokens, so a rejected draft costs nothing but a length change.

`HFBackend` wraps any transformers causal LM with a `DynamicCache`. A second
backend (llama.cpp, vLLM, ...) implements the same four methods and the engine
does not change.
"""

from __future__ import annotations

import time
from typing import Protocol, Sequence

import torch


class Backend(Protocol):
    """A model with a rollback-able KV cache."""

    vocab_size: int

    @property
    def cache_len(self) -> int:
        """Number of tokens currently held in the cache."""
        ...

    def reset(self) -> None:
        """Empty the cache."""
        ...

    def score(self, token_ids: Sequence[int], last_only: bool = False) -> torch.Tensor:
        """Append tokens to the cache; logits [n, V] (or [1, V] if last_only)."""
        ...

    def rollback(self, length: int) -> None:
        """Keep only the first `length` cached tokens."""
        ...

    def synchronize(self) -> None:
        """Wait for queued device work, so that wall-clock timings are honest."""
        ...


class HFBackend:
    """A transformers causal LM with a DynamicCache, batch size 1."""

    def __init__(self, model: torch.nn.Module, device: torch.device | str = "cpu") -> None:
        self.model = model
        self.device = torch.device(device)
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self._cache = None
        self._len = 0

    @property
    def cache_len(self) -> int:
        """Number of tokens currently held in the cache."""
        return self._len

    def reset(self) -> None:
        """Empty the cache."""
        from transformers import DynamicCache

        self._cache = DynamicCache(config=self.model.config)
        self._len = 0

    @torch.inference_mode()
    def score(self, token_ids: Sequence[int], last_only: bool = False) -> torch.Tensor:
        """Append tokens to the cache; logits [n, V] (or [1, V] if last_only), fp32."""
        if self._cache is None:
            self.reset()
        input_ids = torch.tensor([list(token_ids)], dtype=torch.long, device=self.device)  # [1, n]
        positions = torch.arange(self._len, self._len + input_ids.shape[1], device=self.device)  # [n]
        out = self.model(
            input_ids=input_ids,
            past_key_values=self._cache,
            use_cache=True,
            position_ids=positions.unsqueeze(0),
            logits_to_keep=1 if last_only else 0,
        )
        self._len += input_ids.shape[1]
        return out.logits[0].float().cpu()  # [n, V]; verification runs on the CPU

    def rollback(self, length: int) -> None:
        """Keep only the first `length` cached tokens."""
        if length < self._len:
            self._cache.crop(length - self._len)  # transformers 5 takes minus the tokens to drop
            self._len = length

    def synchronize(self) -> None:
        """Wait for queued device work."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


class Stopwatch:
    """Accumulates seconds per named phase; synchronizes the device at each edge."""

    def __init__(self, sync=lambda: None) -> None:
        self.seconds: dict[str, float] = {}
        self._sync = sync

    def time(self, phase: str):
        """Context manager that adds the elapsed time to `phase`."""
        return _Phase(self, phase)


class _Phase:
    def __init__(self, watch: Stopwatch, phase: str) -> None:
        self.watch, self.phase = watch, phase

    def __enter__(self):
        self.watch._sync()
        self.start = time.perf_counter()

    def __exit__(self, *exc):
        self.watch._sync()
        elapsed = time.perf_counter() - self.start
        self.watch.seconds[self.phase] = self.watch.seconds.get(self.phase, 0.0) + elapsed
