"""The one composition root: a target on its engine with its numerics, the sequences it scores, its drafter.

`SpeculativeDecoder.from_names` (the API, `draftlab generate`, the study's cells) and `draftlab serve`'s
`build_served` both compose through here: the same target file, kernels and route, the same drafter from the same
spec, so a served request decodes as `draftlab generate` does. What differs is only how many sequences the target
scores at once: one (`one_sequence`) or a slot per request in flight (`slot_sequences`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftlab.backends import Backend, Engine, engine_of_backend, make_backend
from draftlab.backends.gguf import sequence_ids
from draftlab.backends.llamacpp_sequences import LlamaCppSequences
from draftlab.backends.routes import Route, parse_route
from draftlab.backends.sequences import Sequences
from draftlab.backends.slots import BackendSlots
from draftlab.defaults import DEFAULT_BACKEND
from draftlab.drafters.base import Drafter
from draftlab.drafters.kinds import proposes_trees
from draftlab.drafters.served import ServedModelDrafter
from draftlab.errors import DraftlabError
from draftlab.models import LoadedModel, ModelSpec, load_model
from draftlab.registry import BuiltDraft, build_drafter

DEFAULT_NUMERICS = ("auto", "exact")  # the exact kernels (llama.cpp), the exact route measured fastest here (torch)


@dataclass(frozen=True)
class TargetSpec:
    """A target by name, and how it runs."""

    target: str  # a short name, a GGUF file or an HF directory
    backend: str = DEFAULT_BACKEND
    device: str = ModelSpec.device
    dtype: str = ModelSpec.dtype
    numerics: str = "auto"  # llama.cpp: auto/exact (block rows as single rows) or repack; torch: auto/exact or a
    # route label ("fp32 exact-wm/4")


@dataclass(frozen=True)
class Target:
    """A loaded target, the backend it runs on (llamacpp, or a torch backend: auto, fast, hf) and its route (torch;
    None: the exact route measured fastest here)."""

    loaded: LoadedModel
    backend: str
    route: Route | None = None

    @property
    def on_gguf(self) -> bool:
        """The GGUF file itself in llama.cpp (else torch)."""
        return engine_of_backend(self.backend).runs_gguf


def load_target(spec: TargetSpec) -> Target:
    """Load the target on its engine with its numerics."""
    engine = engine_of_backend(spec.backend)
    if engine.runs_gguf:
        _check_gguf_numerics(engine, spec.numerics)
        repack = True if spec.numerics == "repack" else None  # exact: repacked only where rows stay exact
        return Target(load_model(spec.target, dtype=spec.dtype, backend=engine.backend, repack=repack), engine.backend)
    route = _route(spec.numerics, spec.dtype)
    dtype = route.dtype if route is not None else spec.dtype
    return Target(load_model(ModelSpec(spec.target, device=spec.device, dtype=dtype), backend=spec.backend),
                  spec.backend, route)


def given_target(loaded: LoadedModel, numerics: str = "auto", backend: str = DEFAULT_BACKEND,
                 dtype: str = ModelSpec.dtype) -> Target:
    """A target loaded already (the API's `from_names(LoadedModel)`): its numerics checked against how it was loaded
    (`backend` and `dtype`: what the caller asked for, for a torch target's route)."""
    if not loaded.engine.runs_gguf:
        return Target(loaded, backend, _route(numerics, dtype))
    _check_gguf_numerics(loaded.engine, numerics)
    if (numerics == "repack" and not loaded.model.repack) or (numerics == "exact" and not loaded.model.rows_exact):
        raise DraftlabError(f"the target was loaded with repack={loaded.model.repack}; --numerics {numerics} "
                            "needs it loaded again")
    return Target(loaded, loaded.engine.backend)


def one_sequence(target: Target) -> Backend:
    """The target scoring one sequence (`draftlab generate`, the API, a study cell)."""
    return make_backend(target.loaded.model, target.loaded.device, target.backend, route=target.route)


def slot_sequences(target: Target, slots: int, context: int | None, threads: int | None = None) -> Sequences:
    """The target scoring a sequence per slot in one call (`draftlab serve`): on llama.cpp a KV stream per slot, every
    slot's block in one decode; on torch a backend per slot on the same weights and route."""
    loaded = target.loaded
    if target.on_gguf:
        return LlamaCppSequences(loaded.model, slots, context, threads)
    n_ctx = min(context or loaded.context_length, loaded.context_length)
    return BackendSlots(lambda: one_sequence(target), slots, n_ctx)


def target_drafter(spec: str, target: Target) -> BuiltDraft:
    """The drafter a spec names, on the target's engine (`draftlab.registry`'s grammar)."""
    return build_drafter(spec, target.loaded, target.backend)


@dataclass(frozen=True)
class ServedDraft:
    """The drafter of `draftlab serve`'s engine, and a draft model's streams (a KV stream per slot) where it runs
    one: their cost is weighed beside the target's."""

    drafter: Drafter
    streams: Sequences | None = None


def served_drafter(spec: str, target: Target, slots: int, context: int | None, threads: int | None = None
                   ) -> ServedDraft:
    """The drafter a spec names, for a slot per request in flight: a draft model (`model:...`, `layers:...`) in a
    stream per slot, drafting every request's positions together (`drafters.served`); the others as `draftlab
    generate` builds them (their `beside` says whether they serve several sequences)."""
    built = target_drafter(spec, target)
    if target.on_gguf:
        _check_served_on_gguf(spec)
    if built.model_drafter is None or built.drafter is not built.model_drafter:
        return ServedDraft(built.drafter)
    streams = _draft_streams(built.model, built.model_drafter.vocab_map, target, slots, context, threads)
    return ServedDraft(ServedModelDrafter(built.model_drafter, streams), streams)


def _check_served_on_gguf(spec: str) -> None:
    """A one-line error at startup for token trees where the loaded llama.cpp library cannot put a request's tree
    leaves in its KV stream (built without draftlab's stream-leaves patch). Drafts reading the final hidden states
    are built from the target's torch weights, which a GGUF target refuses already (`registry`)."""
    if proposes_trees(spec) and not sequence_ids():
        raise DraftlabError(f"this llama.cpp library verifies token trees in one sequence only: serve {spec} on a "
                            "library rebuilt with scripts/build-llama-cpp.sh (draftlab's stream-leaves patch), or on "
                            "torch (--backend auto)")


def _draft_streams(draft: LoadedModel, head_rows: torch.Tensor | None, target: Target, slots: int,
                   context: int | None, threads: int | None) -> LlamaCppSequences | BackendSlots:
    """A draft model with a cache per slot, as the target's: its GGUF in a KV stream per slot (a cut draft's GGUF
    holds its trimmed head), or a torch backend per slot on its weights (a cut draft's `head_rows` [V'])."""
    if target.on_gguf:
        return LlamaCppSequences(draft.model, slots, context, threads)
    n_ctx = min(context or draft.context_length, draft.context_length)
    return BackendSlots(lambda: make_backend(draft.model, draft.device, target.backend, batch_invariant=False,
                                             head_rows=head_rows), slots, n_ctx)


def _check_gguf_numerics(engine: Engine, numerics: str) -> None:
    if numerics not in engine.numerics:
        raise DraftlabError(f"--numerics on {engine} is one of {', '.join(engine.numerics)}, not {numerics!r}")


def _route(numerics: str, dtype: str | None) -> Route | None:
    """A torch target's route: None for the exact route measured fastest here, else the label's (its dtype the
    weights' where one is asked)."""
    if numerics in DEFAULT_NUMERICS:
        return None
    route = parse_route(numerics, None if dtype in (None, "auto") else dtype)
    if dtype not in (None, "auto", route.dtype):
        raise DraftlabError(f"--numerics {route.label} runs {route.dtype}, not --dtype {dtype}")
    return route
