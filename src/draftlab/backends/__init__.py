"""Backends: one file per backend, and the registry that builds them by name.

Adding a backend is one new file implementing `Backend` (base.py) and one
entry in `BACKENDS`.
"""

from __future__ import annotations

from typing import Callable

import torch

from draftlab.backends.base import Backend, Stopwatch
from draftlab.backends.fast_llama import SUPPORTED_MODEL_TYPES, FastLlamaBackend
from draftlab.backends.gguf import LlamaCppModel
from draftlab.backends.hf import HFBackend
from draftlab.backends.llamacpp import LlamaCppBackend
from draftlab.backends.engines import (  # noqa: F401  (the engines' interface)
    IN_PROCESS, LLAMA_SERVER, LLAMACPP, SERVED, SGLANG, TORCH, VLLM, Engine, PlainMode, default_kernels_plain,
    engine_named, engine_of_backend, engine_of_model,
)
from draftlab.backends.routes import Route, plain_contenders
from draftlab.defaults import DEFAULT_BACKEND
from draftlab.errors import DraftlabError

BACKENDS: dict[str, Callable[..., Backend]] = {  # (model, device, batch_invariant=, head_rows=) -> Backend
    "fast": FastLlamaBackend,
    "hf": HFBackend,
    "llamacpp": LlamaCppBackend,  # takes a LlamaCppModel (a GGUF loaded with `load_model(..., backend="llamacpp")`)
}
BACKEND_NAMES = ("auto", *BACKENDS)


def check_backend_name(kind: str) -> str:
    """`kind` if it names a backend (or 'auto'); a clear error otherwise."""
    if kind not in BACKEND_NAMES:
        raise DraftlabError(f"unknown backend {kind!r}; use one of {', '.join(BACKEND_NAMES)}")
    return kind


def make_backend(
    model: torch.nn.Module | LlamaCppModel,
    device: torch.device | str = "cpu",
    kind: str = DEFAULT_BACKEND,
    batch_invariant: bool | None = None,
    head_rows: torch.Tensor | None = None,
    route: Route | None = None,
) -> Backend:
    """A backend for `model`: 'fast' (draftlab's forward), 'hf' (transformers) or 'auto' (fast where supported);
    a GGUF model loaded in llama.cpp gets 'llamacpp' (under 'auto' too).

    `batch_invariant`: score every block row bitwise as if alone (None: the backend's default, on in bf16/fp16
    for the fast backend); drafts pass False, since their rounding never affects what is committed.

    `head_rows` [V']: logits for these vocabulary rows only, [n, V'] (drafts with a cut vocabulary).

    `route`: the fast backend's products (`draftlab.backends.routes`); None: measured on this host.
    """
    check_backend_name(kind)
    if isinstance(model, LlamaCppModel) or kind == LLAMACPP.backend:
        return _llamacpp_backend(model, kind, route, head_rows)
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


def _llamacpp_backend(model, kind: str, route: Route | None, head_rows: torch.Tensor | None) -> Backend:
    """llama.cpp's backend for a model loaded in llama.cpp; a clear error for any other pairing."""
    if not isinstance(model, LlamaCppModel):
        raise DraftlabError("--backend llamacpp runs GGUF files loaded in llama.cpp; load the model with "
                            "load_model(..., backend='llamacpp') (the CLI does so under --backend llamacpp)")
    if kind not in (TORCH.backend, LLAMACPP.backend):
        raise DraftlabError(f"{model.path.name} is loaded in llama.cpp; the {kind} backend needs a torch model")
    if route is not None:
        raise DraftlabError("routes (--numerics) choose the torch backend's products; llama.cpp uses its own kernels")
    return LlamaCppBackend(model, head_rows=head_rows)


def other_routes(backend: Backend, config, device: str) -> list[Route]:
    """The fastest route of each other dtype for plain decoding of a model on draftlab's forward (the backend's own
    route excluded); none for other backends."""
    if not isinstance(backend, FastLlamaBackend):
        return []
    return plain_contenders(config, device, backend.route)


__all__ = ["BACKENDS", "BACKEND_NAMES", "Backend", "FastLlamaBackend", "HFBackend", "LlamaCppBackend", "LlamaCppModel", "Stopwatch", "check_backend_name",
           "make_backend", "other_routes"]
