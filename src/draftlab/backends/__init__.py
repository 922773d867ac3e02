"""Backends: one file per backend, and the registry that builds them by name.

Adding a backend is one new file implementing `Backend` (base.py) and one
entry in `BACKENDS`.
"""

from __future__ import annotations

from typing import Callable

import torch

from draftlab.backends.base import Backend, Stopwatch
from draftlab.backends.fast_llama import SUPPORTED_MODEL_TYPES, FastLlamaBackend
from draftlab.backends.hf import HFBackend
from draftlab.backends.routes import Route
from draftlab.defaults import DEFAULT_BACKEND
from draftlab.errors import DraftlabError

BACKENDS: dict[str, Callable[..., Backend]] = {  # (model, device, batch_invariant=, head_rows=) -> Backend
    "fast": FastLlamaBackend,
    "hf": HFBackend,
}
BACKEND_NAMES = ("auto", *BACKENDS)


def check_backend_name(kind: str) -> str:
    """`kind` if it names a backend (or 'auto'); a clear error otherwise."""
    if kind not in BACKEND_NAMES:
        raise DraftlabError(f"unknown backend {kind!r}; use one of {', '.join(BACKEND_NAMES)}")
    return kind


def make_backend(
    model: torch.nn.Module,
    device: torch.device | str = "cpu",
    kind: str = DEFAULT_BACKEND,
    batch_invariant: bool | None = None,
    head_rows: torch.Tensor | None = None,
    route: Route | None = None,
) -> Backend:
    """A backend for `model`: 'fast' (draftlab's forward), 'hf' (transformers) or 'auto' (fast where supported).

    `batch_invariant`: score every block row bitwise as if alone (None: the backend's default, on in bf16/fp16
    for the fast backend); drafts pass False, since their rounding never affects what is committed.

    `head_rows` [V']: logits for these vocabulary rows only, [n, V'] (drafts with a cut vocabulary).

    `route`: the fast backend's products (`draftlab.backends.routes`); None: measured on this host.
    """
    check_backend_name(kind)
    supported = getattr(model.config, "model_type", None) in SUPPORTED_MODEL_TYPES
    if kind == "fast" and not supported:
        raise DraftlabError(
            f"the fast backend supports model types {SUPPORTED_MODEL_TYPES}, not {model.config.model_type!r}; "
            "use --backend hf"
        )
    if kind == "auto":
        kind = "fast" if supported else "hf"
    if (batch_invariant or route is not None) and kind == "hf":
        raise DraftlabError("the hf backend cannot score blocks batch-invariantly or choose a route; use --backend fast")
    if route is not None:
        return FastLlamaBackend(model, device, head_rows=head_rows, route=route)
    return BACKENDS[kind](model, device, batch_invariant=batch_invariant, head_rows=head_rows)


__all__ = ["BACKENDS", "BACKEND_NAMES", "Backend", "FastLlamaBackend", "HFBackend", "Stopwatch", "check_backend_name",
           "make_backend"]
