"""The parts of a model draft's spec (`model:NAME[@TYPE|@DTYPE][,head=N][,window=N]`) and the GGUF a draft runs
from."""

from __future__ import annotations

import os

from draftlab.backends.quantize import WEIGHT_TYPES
from draftlab.defaults import DRAFT_WEIGHT_TYPE
from draftlab.errors import DraftlabError
from draftlab.files.assets import MODEL_ASSETS
from draftlab.models import DTYPES, dtype_name, split_weight_type


OPTIONS = {  # a model draft's options after its name: what N means
    "window": "the prompt's last N tokens the draft reads",
    "head": "the draft's LM head keeps its N lowest token ids (and the end-of-sequence ids)",
}


def split_options(arg: str) -> tuple[str, dict[str, int]]:
    """'qwen2.5-coder-0.5b,head=32768,window=128' -> ('qwen2.5-coder-0.5b', {'head': 32768, 'window': 128}), in any
    order; no options -> (arg, {})."""
    options: dict[str, int] = {}
    while True:
        at, name = max((arg.rfind(f",{n}="), n) for n in OPTIONS)  # the last option
        if at < 0:
            return arg, options
        arg, tail = arg[:at], arg[at + len(name) + 2:]
        if not tail.isdigit() or int(tail) < 1 or name in options:
            raise DraftlabError(f"bad draft {name} {tail!r}: {OPTIONS[name]}, N >= 1, given once")
        options[name] = int(tail)


def split_dtype(arg: str) -> tuple[str, str]:
    """'qwen2.5-coder-0.5b@bf16' -> ('qwen2.5-coder-0.5b', 'bf16'); no '@', a path ('a@b/dir') or a GGUF weight
    type in capitals ('NAME@Q4_0_PURE') -> (arg, '')."""
    head, at, tail = arg.rpartition("@")
    if not at or "/" in tail or os.path.exists(arg) or tail in WEIGHT_TYPES:
        return arg, ""  # no dtype: a path, or a GGUF's weight type in capitals (NAME@Q4_0_PURE) that names the file
    if tail not in DTYPES:
        raise DraftlabError(f"unknown draft dtype {tail!r} in {arg!r}: use @fp32, @bf16 or @fp16")
    return head, dtype_name(tail)


def gguf_draft(model: str) -> str:
    """The GGUF a draft model runs from on llama.cpp: a short name's own file in `DRAFT_WEIGHT_TYPE` (derived once),
    since a draft's weight type changes only which tokens it proposes, never what is committed; a path, or a name
    with its weight type (NAME@Q4_K_M), as given."""
    if model in MODEL_ASSETS and split_weight_type(model)[1] is None:
        return f"{model}@{DRAFT_WEIGHT_TYPE}"
    return model
