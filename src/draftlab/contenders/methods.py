"""The methods a study's cells run, gathered from the engines it races: the one place that knows them by name.

A cell's `method` (stored in every record and cell key) names a method of one engine: `backends.engines.ENGINES`
lists the engines, each naming the module of `draftlab.contenders` that holds its `METHODS`
(`contenders.contract.Method`). Code elsewhere asks a method's entry (`method_of(name)`): its contender, whether
it is a plain decoding and on which engine, whether its outputs equal plain decoding token for token or only up to
rounding, its label in tables and plots. No module outside the tables compares a method name with a string
(tests/test_structure.py): racing a new engine is one entry of `ENGINES` and one contender module.
"""

from __future__ import annotations

import importlib
from functools import lru_cache

from draftlab.backends import engines
from draftlab.contenders.contract import Method
from draftlab.contenders.hf import ASG, HF
from draftlab.contenders.llama_cpp_python import LCP, LLAMA
from draftlab.contenders.plain import AR, PLAIN, SPS
from draftlab.contenders.server_configs import SERVER, SERVER_AR
from draftlab.contenders.draftlab_serve import SERVE, SERVE_AR
from draftlab.contenders.vllm import VLLM, VLLM_AR
from draftlab.errors import DraftlabError

# the built-in methods, named where code needs one, and the registry's functions
__all__ = ["AR", "ASG", "HF", "LCP", "LLAMA", "PLAIN", "SERVE", "SERVE_AR", "SERVER", "SERVER_AR", "SPS", "VLLM",
           "VLLM_AR", "Method",
           "choices", "is_baseline", "method_of", "methods"]


def methods() -> dict[str, Method]:
    """Every method of every engine of `ENGINES`, by name, in the table's order."""
    return _methods_of(engines.ENGINES)


@lru_cache(maxsize=4)
def _methods_of(table: tuple[engines.Engine, ...]) -> dict[str, Method]:
    found: dict[str, Method] = {}
    for engine in table:
        for method in importlib.import_module(engine.methods_from).METHODS if engine.methods_from else ():
            if method.name in found:
                raise DraftlabError(f"two engines name the method {method.name!r}")
            found[method.name] = method
    return found


def choices() -> tuple[str, ...]:
    """The methods `--methods` names (plain modes follow host_baselines, llama-server's follow --servers)."""
    return tuple(name for name, method in methods().items() if method.chosen)


def method_of(name: str) -> Method:
    """The method a record or cell names."""
    try:
        return methods()[name]
    except KeyError:
        raise DraftlabError(f"unknown method {name!r}: use one of {', '.join(methods())}") from None


def is_baseline(name: str) -> bool:
    """Whether the method is draftlab's plain decoding, every cell's speedup reference."""
    return name == AR.name
