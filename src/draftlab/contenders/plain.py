"""Plain decoding in every mode a target runs in here: the baselines every speedup must beat.

The study, bench and the tuner compare a speculative decoder with plain decoding on the same target in its own
mode (`autoregressive`) and in the host's other fast modes (`host_plain`): the fastest route of each other dtype
of draftlab's forward, and llama.cpp's default kernels where the target is a GGUF. None of these belongs to the
user's API (`SpeculativeDecoder`); they are what a measurement puts beside it.
"""

from __future__ import annotations

import copy

from draftlab.api import SpeculativeDecoder
from draftlab.backends import FastLlamaBackend, PlainMode, default_kernels_plain
from draftlab.backends import other_routes
from draftlab.backends.routes import Route, parse_route
from draftlab.contenders.contract import ContenderSource, Method
from draftlab.drafters.base import NoDrafter
from draftlab.models import DTYPES, LoadedModel, dtype_name, is_gguf
from draftlab.decoding.policy import FixedK

DEFAULT_KERNELS = "llama.cpp repack"  # the label of plain decoding on llama.cpp's default kernels


def autoregressive(decoder: SpeculativeDecoder) -> SpeculativeDecoder:
    """Plain decoding of the decoder's target on its own backend (shared, with its cache and prompt cache)."""
    return SpeculativeDecoder(decoder.target, NoDrafter(), FixedK(1), decoder.target_backend, backend=decoder.backend,
                              prompt_cache=decoder.prompt_cache)


def plain_in(decoder: SpeculativeDecoder, route: Route) -> SpeculativeDecoder:
    """Plain decoding of the decoder's target in another mode: the route's dtype (the weights copied) and products."""
    target = decoder.target
    if route.dtype != dtype_name(target.dtype):
        model = copy.deepcopy(target.model).to(DTYPES[route.dtype])
        target = LoadedModel(target.name, model, target.tokenizer, target.device, DTYPES[route.dtype], target.source)
    backend = FastLlamaBackend(target.model, target.device, route=route)
    return SpeculativeDecoder(target, NoDrafter(), FixedK(1), backend, backend=decoder.backend)


def default_kernels(decoder: SpeculativeDecoder) -> SpeculativeDecoder | None:
    """Plain decoding of the target's GGUF on llama.cpp's default kernels (the decoder itself when it runs there
    already); None when the target has no such mode here."""
    mode = _default_kernels(decoder)
    if mode is None:
        return None
    if mode.same:
        return autoregressive(decoder)
    return SpeculativeDecoder.from_names(decoder.target.source, drafter="none", k=1, backend=mode.backend,
                                         numerics=mode.numerics)


def host_plain(decoder: SpeculativeDecoder) -> dict[str, SpeculativeDecoder]:
    """Plain decoding in the host's other fast modes, by label: the fastest route of each dtype other than the
    decoder's own (draftlab's forward on a CPU), and llama.cpp's default kernels where the target is a GGUF and
    llama-cpp-python is installed. What a speedup must also beat."""
    target = decoder.target
    routes = other_routes(decoder.target_backend, target.model.config, str(target.device))
    modes = {route.label: plain_in(decoder, route) for route in routes}
    kernels = _default_kernels(decoder)
    if kernels is not None and not kernels.same:
        modes[DEFAULT_KERNELS] = default_kernels(decoder)
    return modes


def _default_kernels(decoder: SpeculativeDecoder) -> PlainMode | None:
    target = decoder.target
    return default_kernels_plain(target.model, str(target.device), is_gguf(target.source))


def fastest_plain(decoder: SpeculativeDecoder) -> SpeculativeDecoder:
    """The plain decoding a race on the decoder's engine runs against: llama.cpp's default kernels for a target
    on llama.cpp (its fastest plain decoding), the decoder's own mode otherwise."""
    if decoder.target.engine.runs_gguf:
        return default_kernels(decoder) or autoregressive(decoder)
    return autoregressive(decoder)


def plain_mode(decoder: SpeculativeDecoder, label: str) -> SpeculativeDecoder:
    """Plain decoding in the mode a label names (a route's label, or `DEFAULT_KERNELS`)."""
    return default_kernels(decoder) if label == DEFAULT_KERNELS else plain_in(decoder, parse_route(label))


def _cell_decoder(source: ContenderSource, cell, _companions: tuple) -> SpeculativeDecoder:
    return source.cell_decoder(cell)


def _plain_in(source: ContenderSource, cell, _companions: tuple) -> SpeculativeDecoder:
    return source.plain_in(cell.drafter)


AR = Method("ar", "plain decoding", 0, "draftlab", plain=True, reference="ar", swept=False, build=_cell_decoder)
PLAIN = Method("plain", "plain decoding in another mode", 1, "draftlab", plain=True, reference="ar", swept=False,
               chosen=False, build=_plain_in)  # a cell per mode of `SweepConfig.host_modes` (drafter: its label)
SPS = Method("sps", "SpS", 3, "draftlab", plain=False, reference="ar", build=_cell_decoder)
METHODS = (AR, PLAIN, SPS)
