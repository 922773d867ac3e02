"""Other weight types of a GGUF, derived with llama.cpp's own quantizer: the weight type as a dimension.

A block of n tokens costs a different multiple of one token for each weight type (on an AVX-512 BF16 host a BF16
block of 4 cost 1.65 single tokens where Q4_1's cost 2.54), so which type to deploy is part of whether speculation
pays. `derive_weight_type` writes the target's GGUF in another type (`llama_model_quantize`, requantizing when the
file is quantized already: the new file carries the source's rounding too), once, into draftlab's cache keyed by
the source file's SHA256, with the new file's own SHA256 beside it; a cached file whose checksum no longer matches
is derived again. Changing the weight type changes the model's outputs: compare them with the shipped type's.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

from draftlab.files.assets import sha256_file
from draftlab.backends.gguf import llama_lib, threads
from draftlab.errors import DraftlabError
from draftlab.files.safeio import write_atomic

WEIGHT_TYPES = {  # the name users give -> llama.cpp's file type constant
    "F32": "LLAMA_FTYPE_ALL_F32", "F16": "LLAMA_FTYPE_MOSTLY_F16", "BF16": "LLAMA_FTYPE_MOSTLY_BF16",
    "Q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "Q6_K": "LLAMA_FTYPE_MOSTLY_Q6_K", "Q5_K_M": "LLAMA_FTYPE_MOSTLY_Q5_K_M",
    "Q4_K_M": "LLAMA_FTYPE_MOSTLY_Q4_K_M", "Q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0", "Q4_1": "LLAMA_FTYPE_MOSTLY_Q4_1",
    "Q4_0_PURE": "LLAMA_FTYPE_MOSTLY_Q4_0", "IQ4_NL": "LLAMA_FTYPE_MOSTLY_IQ4_NL",
}
# Types whose every tensor gets the file's type (llama-quantize --pure): Q4_0 keeps its LM head in Q8_0 otherwise,
# which no repacked kernel serves on x86; pure, every product of a decode step runs the repacked Q4_0 kernels.
PURE = frozenset({"Q4_0_PURE"})


def weight_type_name(text: str) -> str:
    """A weight type's name ('bf16' -> 'BF16'), or a one-line error listing the known ones."""
    name = text.upper()
    if name not in WEIGHT_TYPES:
        raise DraftlabError(f"unknown weight type {text!r}; llama.cpp's quantizer writes {', '.join(WEIGHT_TYPES)}")
    return name


def derived_path(source: Path, weight_type: str, cache_root: Path) -> Path:
    """Where `derive_weight_type` writes `source` (a GGUF) in `weight_type`: keyed by the source's SHA256."""
    name = weight_type_name(weight_type)
    return cache_root / "weight-types" / sha256_file(source)[:16] / f"{source.stem}.{name}.gguf"


def derive_weight_type(source: Path, weight_type: str, cache_root: Path) -> Path:
    """`source` (a GGUF) written in `weight_type`, derived once and cached; the cached file's path."""
    name = weight_type_name(weight_type)
    out = derived_path(source, name, cache_root)
    out_dir = out.parent
    checksum = out.with_name(out.name + ".sha256")
    if out.exists() and checksum.exists() and checksum.read_text().strip() == sha256_file(out):
        return out
    out_dir.mkdir(parents=True, exist_ok=True)
    partial = out_dir / f".{out.name}.{os.getpid()}.partial"
    lib = llama_lib()
    params = lib.llama_model_quantize_default_params()
    params.ftype = getattr(lib, WEIGHT_TYPES[name])
    params.allow_requantize = True
    params.pure = name in PURE
    params.nthread = threads()
    code = lib.llama_model_quantize(str(source).encode(), str(partial).encode(), ctypes.byref(params))
    if code != 0 or not partial.exists():
        partial.unlink(missing_ok=True)
        raise DraftlabError(f"llama.cpp's quantizer could not write {source.name} as {name} (code {code}); try another "
                            f"weight type ({', '.join(WEIGHT_TYPES)})")
    write_atomic(checksum, sha256_file(partial) + "\n")
    partial.replace(out)
    return out
