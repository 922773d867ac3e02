"""The engines a target runs on, and what each can do: the one place that knows them by name.

Code outside `backends/` asks a target's `Engine` (`LoadedModel.engine`) what it can do: whether it loads GGUF
files as they are, whether drafts built from the target's torch weights run on it, which numerics it takes, which
plain decoding is its fastest. It never compares engine names with strings (tests/test_structure.py): it names an
entry of this table. The served engines are here too: llama-server, which draftlab starts, races and exports to,
vLLM, which it starts (in an environment of its own), races and exports to, and SGLang, which it exports to.

`ENGINES` is the one table. An engine a study races names, in `methods_from`, the module of `draftlab.contenders`
that holds its methods (`contenders.contract`): racing a new engine is one entry here and that one module.
"""

from __future__ import annotations

from dataclasses import dataclass

from draftlab.backends.gguf import LlamaCppModel, available
from draftlab.errors import DraftlabError

LLAMACPP_NUMERICS = ("auto", "exact", "repack")


@dataclass(frozen=True)
class Engine:
    """An engine a target runs on."""

    name: str  # for records
    label: str  # for people
    backend: str  # the backend name that loads a target on it ('auto': draftlab's forward, else transformers)
    runs_gguf: bool  # loads GGUF files as they are (no de-quantization into torch)
    torch_drafts: bool  # drafts built from the target's torch weights (layer, designed, feature, heads) run on it
    numerics: tuple[str, ...]  # the --numerics it takes; empty: the torch backend's routes
    tapped_drafts: bool = False  # drafts reading the inputs of target layers (EAGLE-3) run on it
    served: bool = False  # an OpenAI-compatible server (a process of its own), not a backend in this process
    methods_from: str = ""  # the module whose `METHODS` a study races on it ('': none; `contenders.methods`)

    def __str__(self) -> str:
        return self.label


# draftlab's own decoder: its methods run on the target's in-process engine, torch or llama.cpp
TORCH = Engine("torch", "torch", "auto", runs_gguf=False, torch_drafts=True, numerics=(), tapped_drafts=True,
               methods_from="draftlab.contenders.plain")
LLAMACPP = Engine("llamacpp", "llama.cpp", "llamacpp", runs_gguf=True, torch_drafts=False, numerics=LLAMACPP_NUMERICS,
                  tapped_drafts=True)  # layer inputs recorded by llama.cpp itself (backends/llamacpp.py)
IN_PROCESS = (TORCH, LLAMACPP)  # the backends' engines: a target loads on one of them in this process
HF_GENERATE = Engine("hf-generate", "HF generate", "", runs_gguf=False, torch_drafts=True, numerics=(),
                     methods_from="draftlab.contenders.hf")  # a peer in this process: transformers' `generate`
LLAMA_CPP_PYTHON = Engine("llama-cpp-python", "llama-cpp-python", "", runs_gguf=True, torch_drafts=False, numerics=(),
                          methods_from="draftlab.contenders.llama_cpp_python")  # a peer in this process
LLAMA_SERVER = Engine("llama-server", "llama-server", "", runs_gguf=True, torch_drafts=False, numerics=(), served=True,
                      methods_from="draftlab.contenders.server_configs")
VLLM = Engine("vllm", "vLLM", "", runs_gguf=False, torch_drafts=True, numerics=(), served=True,
              methods_from="draftlab.contenders.vllm")  # in its own environment, made on demand
SGLANG = Engine("sglang", "SGLang", "", runs_gguf=False, torch_drafts=True, numerics=(), served=True)
DRAFTLAB_SERVE = Engine("draftlab-serve", "draftlab serve", "", runs_gguf=True, torch_drafts=False, numerics=(),
                        served=True, methods_from="draftlab.contenders.draftlab_serve")  # draftlab's own server
SERVED = (VLLM, SGLANG, LLAMA_SERVER)  # the servers a study's answer is exported to (llama-server is also raced)
ENGINES = (*IN_PROCESS, HF_GENERATE, LLAMA_CPP_PYTHON, *SERVED, DRAFTLAB_SERVE)  # every engine draftlab knows


def engine_named(name: str) -> Engine:
    """The engine of that name (in records, environment variables and `--export`)."""
    found = next((e for e in ENGINES if e.name == name), None)
    if found is None:
        raise DraftlabError(f"unknown engine {name!r}: one of {', '.join(e.name for e in ENGINES)}")
    return found


def engine_of_backend(backend: str) -> Engine:
    """The engine a backend name (`--backend`) runs targets on."""
    return next((e for e in IN_PROCESS if e.backend == backend), TORCH)


def engine_of_model(model) -> Engine:
    """The engine a loaded model runs on."""
    return LLAMACPP if isinstance(model, LlamaCppModel) else TORCH


@dataclass(frozen=True)
class PlainMode:
    """How to load a target for plain decoding in another mode: backend name and numerics."""

    backend: str
    numerics: str
    same: bool  # the given model runs in this mode already


def default_kernels_plain(model, device: str, gguf_source: bool) -> PlainMode | None:
    """Plain decoding on llama.cpp's default (repacked) kernels, the fastest plain decoding of a GGUF there: for a
    model on those kernels already, or a GGUF source on a CPU with llama-cpp-python installed; None otherwise."""
    if isinstance(model, LlamaCppModel) and model.repack:
        return PlainMode(LLAMACPP.backend, "repack", same=True)
    if device == "cpu" and gguf_source and available():
        return PlainMode(LLAMACPP.backend, "repack", same=False)
    return None
