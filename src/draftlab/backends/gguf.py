"""GGUF models in llama.cpp (through llama-cpp-python's low-level API), loaded as they are: no de-quantization.

llama.cpp is an optional dependency (`pip install 'draftlab[llamacpp]'`, which `./run.sh` installs). A row of a block
rounds as the same row scored alone when one kernel serves every row count of a product; llama.cpp's CPU kernel
choices break that in three places, and draftlab's build mends or avoids each (see docs/backends.md):

- llamafile's sgemm served blocks of 2+ rows and vec_dot one row: draftlab's build patches the gate out
  (scripts/llama-cpp/sgemm-every-row.patch), so tinyBLAS, one chain of FMAs per output, serves every row count
  (but one row of Q8_0, Q5_0 or Q4_0, whose vec_dot on AVX2 does per output what tinyBLAS does, and faster);
  `LlamaCppModel.exact_kernels` names the patches the loaded library holds (`EXACT_KERNELS`);
- weight repacking (an "extra buffer type": gemm for the first floor(n/4)*4 rows, gemv for the rest): on x86 the
  repacked Q4_0 kernels give each output the same order of additions in both (integer block sums, then one FMA per
  block), so files of the types in `REPACK_EXACT` load repacked and stay exact; Q4_K's gemm rounds otherwise than
  its gemv, so draftlab's build serves every row count of it with one gemv over the rows
  (scripts/llama-cpp/q4_K-rows.patch) and K-quant files load repacked too (`REPACK_EXACT_Q4_K_ROWS`); files of other
  types (or on a library without that kernel) load with `use_extra_bufts = False`;
- the tiled K-quant matmul that takes over at 8+ rows: `GGML_CPU_TILED_MM=0` in the environment, set before the
  library loads unless the user set it.

ggml's AMX kernels are left out of the build too (`-mno-amx-*`, ./run.sh): on AMX CPUs they die with a general
protection fault in `ggml_backend_amx_mul_mat` at the first repacked decode. `LlamaCppModel.amx` says whether the
installed library has them; `scripts/check-no-amx.sh` checks its symbols.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import re
import struct
import sys
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from draftlab.errors import DraftlabError

EXACT_ENV = {"GGML_CPU_TILED_MM": "0"}  # read by ggml-cpu; set before the library loads
GGML_LOG_LEVEL_ERROR = 4  # ggml.h: NONE 0, DEBUG 1, INFO 2, WARN 3, ERROR 4, CONT 5
INSTALL_HINT = ("install it with ./run.sh --setup-only (it compiles llama.cpp with draftlab's exact kernels and without "
                "ggml's AMX kernels, ~7 minutes on 2 cores)")
SGEMM_EVERY_ROW = "sgemm-every-row"  # scripts/llama-cpp/sgemm-every-row.patch
Q4_0_ROWS = "q4_0-rows"  # scripts/llama-cpp/q4_0-rows.patch: one gemv over a block's rows for repacked Q4_0
Q4_K_ROWS = "q4_K-rows"  # scripts/llama-cpp/q4_K-rows.patch: the same for repacked Q4_K, at every row count
EXACT_KERNELS = (SGEMM_EVERY_ROW, Q4_0_ROWS, Q4_K_ROWS)  # each patch exports ggml_cpu_draftlab_<its name, "-" as "_">
TRIMMED_HEAD_SYMBOL = "llama_draftlab_trimmed_head"  # libllama of scripts/llama-cpp/trimmed-head.patch exports it
DRAFT_CHAIN_SYMBOL = "llama_draftlab_draft_greedy"  # scripts/llama-cpp/draft-chain.patch: greedy draft tokens, one call
STREAM_LEAVES_SYMBOL = "llama_draftlab_stream_leaves"  # scripts/llama-cpp/stream-leaves.patch: tree leaves in a stream
# llama.cpp's own calls that hand over the inputs of chosen layers (what its EAGLE-3 drafting reads), declared in its
# src/llama-ext.h without extern "C": exported under their C++ (Itanium ABI) names, which only their signatures fix.
LAYER_INPUTS_ENABLE = "_Z30llama_set_embeddings_layer_inpP13llama_contextjb"  # (ctx, uint32 layer, bool on)
LAYER_INPUTS_READ = "_Z30llama_get_embeddings_layer_inpP13llama_contextj"  # (ctx, uint32 layer) -> float [n, D]
HEAD_ROWS_KEY = "draftlab.head_rows"  # uint32 key of a GGUF whose output.weight keeps that many rows
# Tensor types whose repacked kernels on x86 keep rows exact at every row count (Q4_0's 8x8 gemm and gemv; the others
# are not repacked on x86), proven bitwise per file type by tests/integration/test_exact_kernels.py.
REPACK_EXACT = frozenset({"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"})
# ... and with Q4_K_ROWS in the library: Q4_K's repacked rows too, and the K-quants x86 does not repack (vec_dot, with
# the tiled matmul off). Not Q2_K or IQ4_NL: AVX-512 repacks Q2_K, AVX2 IQ4_NL, each with a gemm of its own.
REPACK_EXACT_Q4_K_ROWS = REPACK_EXACT | {"Q3_K", "Q4_K", "Q5_K", "Q6_K"}


@lru_cache(maxsize=1)
def llama_lib():
    """The `llama_cpp` module, imported once with draftlab's kernel settings and llama.cpp's logging off."""
    for key, value in EXACT_ENV.items():
        os.environ.setdefault(key, value)
    try:
        import llama_cpp
        from llama_cpp import _logger
    except ImportError as exc:
        raise DraftlabError(f"the llamacpp backend needs llama-cpp-python ({exc}); {INSTALL_HINT}") from exc
    _logger.set_verbose(False)
    llama_cpp.llama_log_set(_errors_only(), ctypes.c_void_p(0))
    llama_cpp.llama_backend_init()
    return llama_cpp


def tensor_types(path: Path) -> frozenset[str]:
    """The weight types of a GGUF's tensors ('Q4_0', 'F32', ...), read from its header (once per version of the
    file in a process)."""
    try:
        stat = Path(path).stat()
    except OSError as exc:
        raise DraftlabError(f"cannot read the tensors of GGUF {path}: {exc}") from exc
    return _tensor_types(str(Path(path).resolve()), stat.st_mtime_ns, stat.st_size)


@lru_cache(maxsize=64)
def _tensor_types(path: str, _mtime_ns: int, _size: int) -> frozenset[str]:
    """`tensor_types` of one version of a file (its modification time and size are part of the cache key), from its
    header alone (`gguf_header`: milliseconds, where `gguf.GGUFReader` parses every metadata value)."""
    from gguf import GGMLQuantizationType

    from draftlab.backends.gguf_header import header_tensor_types

    try:
        return frozenset(GGMLQuantizationType(kind).name for kind in header_tensor_types(path))
    except (ValueError, OSError, struct.error) as exc:  # not a GGUF, truncated, an unknown type id
        raise DraftlabError(f"cannot read the tensors of GGUF {path}: {exc}") from exc


def repack_keeps_rows(path: Path, kernels: tuple[str, ...] | None = None) -> bool:
    """Whether llama.cpp's repacked weights keep a block's rows exact for this file on this host, on a library with
    these exact kernels (None: the loaded one's): `REPACK_EXACT`, or `REPACK_EXACT_Q4_K_ROWS` with `Q4_K_ROWS`."""
    kernels = exact_kernels() if kernels is None else kernels
    exact = REPACK_EXACT_Q4_K_ROWS if Q4_K_ROWS in kernels else REPACK_EXACT
    return platform.machine() in ("x86_64", "AMD64") and tensor_types(path) <= exact


@lru_cache(maxsize=1)
def exact_kernels() -> tuple[str, ...]:
    """The names of draftlab's kernel patches in the loaded ggml-cpu library (each exports a
    `ggml_cpu_draftlab_<name>` symbol); () for a library built without them."""
    library = _loaded_library("libggml-cpu")
    return tuple(name for name in EXACT_KERNELS
                 if library is not None and hasattr(library, "ggml_cpu_draftlab_" + name.replace("-", "_")))


@lru_cache(maxsize=1)
def loads_trimmed_heads() -> bool:
    """Whether the loaded libllama loads vocabulary-trimmed heads (draftlab's scripts/llama-cpp/trimmed-head.patch,
    which exports `TRIMMED_HEAD_SYMBOL`; `draftlab.backends.gguf_head`)."""
    library = _loaded_library("libllama")
    return library is not None and hasattr(library, TRIMMED_HEAD_SYMBOL)


@lru_cache(maxsize=1)
def sequence_ids() -> int:
    """How many sequence ids a context with a KV stream per sequence takes where the loaded libllama holds draftlab's
    scripts/llama-cpp/stream-leaves.patch (sequence s in stream s % streams: a token tree's leaves share their
    sequence's stream); 0 for a library without it (there a tree verifies only in a single sequence's context)."""
    library = _loaded_library("libllama")
    if library is None or not hasattr(library, STREAM_LEAVES_SYMBOL):
        return 0
    call = library[STREAM_LEAVES_SYMBOL]
    call.argtypes, call.restype = [], ctypes.c_int32
    return int(call())


@lru_cache(maxsize=1)
def greedy_chain_call():
    """The loaded libllama's greedy draft loop (`DRAFT_CHAIN_SYMBOL`, draftlab's scripts/llama-cpp/draft-chain.patch)
    as a ctypes function (context, token, position, n, logits per row, row tokens or None, out rows [n]) -> n fed,
    or -(i + 1) where the i-th decode failed; None on a library without it."""
    library = _loaded_library("libllama")
    if library is None or not hasattr(library, DRAFT_CHAIN_SYMBOL):
        return None
    call = library[DRAFT_CHAIN_SYMBOL]
    call.argtypes = [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32,
                     ctypes.c_void_p, ctypes.c_void_p]
    call.restype = ctypes.c_int32
    return call


@dataclass(frozen=True)
class LayerInputCalls:
    """libllama's calls that record the inputs of chosen layers at every decode: `enable(ctx, layer, on)`, then
    `read(ctx, layer)` points at the last decode's [n_tokens, n_embd] floats (llama.cpp's buffer, reused)."""

    enable: object
    read: object


@lru_cache(maxsize=1)
def layer_input_calls() -> LayerInputCalls | None:
    """`LayerInputCalls` of the loaded libllama; None on a library without them."""
    library = _loaded_library("libllama")
    if library is None or not hasattr(library, LAYER_INPUTS_ENABLE) or not hasattr(library, LAYER_INPUTS_READ):
        return None
    enable, read = library[LAYER_INPUTS_ENABLE], library[LAYER_INPUTS_READ]
    enable.argtypes, enable.restype = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_bool], None
    read.argtypes, read.restype = [ctypes.c_void_p, ctypes.c_uint32], ctypes.POINTER(ctypes.c_float)
    return LayerInputCalls(enable, read)


def _loaded_library(prefix: str) -> ctypes.CDLL | None:
    """The shared library llama-cpp-python loaded whose file name starts with `prefix`, None if none is."""
    llama_lib()
    maps = Path("/proc/self/maps")
    path = next((line.split()[-1] for line in maps.read_text().splitlines()
                 if line.rsplit("/", 1)[-1].startswith(prefix)), None) if maps.exists() else None
    try:
        return ctypes.CDLL(path) if path else None
    except OSError:
        return None


@lru_cache(maxsize=1)
def _errors_only():
    """llama.cpp's log callback: its errors to standard error, nothing else (llama-cpp-python 0.3.36's own callback
    reads ggml's levels of an older release and prints warnings such as "control-looking token ... was not
    control-type" on every Qwen load). Cached: llama.cpp keeps the pointer."""
    from llama_cpp import llama_log_callback

    @llama_log_callback
    def callback(level: int, text: bytes, user_data) -> None:
        if level == GGML_LOG_LEVEL_ERROR:
            print(text.decode("utf-8", "replace"), end="", flush=True, file=sys.stderr)

    return callback


def available() -> bool:
    """True when llama-cpp-python is installed (without importing it)."""
    from importlib.util import find_spec

    return find_spec("llama_cpp") is not None


def system_info() -> str:
    """llama.cpp's own line of compiled-in CPU features ('AVX512 = 1 | LLAMAFILE = 0 | ...')."""
    return llama_lib().llama_print_system_info().decode()


def library_version() -> str:
    """llama-cpp-python's version."""
    return llama_lib().__version__


def threads() -> int:
    """Threads for llama.cpp: the cores this process may run on (as torch uses them)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _head_rows(lib, handle) -> int:
    """The rows of a loaded model's trimmed LM head (`HEAD_ROWS_KEY`), 0 for a whole head."""
    buffer = ctypes.create_string_buffer(32)
    if lib.llama_model_meta_val_str(handle, HEAD_ROWS_KEY.encode(), buffer, len(buffer)) < 0:
        return 0
    return int(buffer.value)


@dataclass
class LlamaCppModel:
    """A GGUF file loaded by llama.cpp, with the HF config and generation config read from its metadata.

    Several backends (contexts) may run on one loaded model; each has its own KV cache.
    """

    path: Path
    handle: object  # llama_model_p
    vocab_handle: object  # llama_vocab_p
    config: object  # transformers PretrainedConfig from the GGUF's metadata
    generation_config: object  # transformers GenerationConfig derived from it
    vocab_size: int
    n_ctx_train: int
    n_layer: int
    n_params: int
    description: str  # llama.cpp's own: 'llama 135M Q4_1', 'qwen2 1.5B Q4_K - Medium'
    repack: bool  # weight repacking on (faster single rows and blocks where the file's types have repacked kernels)
    repack_exact: bool  # repacked or not, rows stay exact for this file's types (`repack_keeps_rows`)
    meta_dir: Path | None = None
    head_rows: int = 0  # rows of a vocabulary-trimmed LM head (`HEAD_ROWS_KEY`), 0 for a whole head
    _twin: "LlamaCppModel | None" = field(default=None, repr=False)

    @classmethod
    def load(cls, path: Path, meta_dir: Path, repack: bool | None = None) -> "LlamaCppModel":
        """Load `path` into llama.cpp; `meta_dir` holds its config (see `describe_gguf`). `repack` None: repacked
        where that keeps rows exact (`repack_keeps_rows`), else not."""
        lib = llama_lib()
        repack_exact = repack_keeps_rows(path)
        repack = repack_exact if repack is None else repack
        params = lib.llama_model_default_params()
        params.use_extra_bufts = repack
        handle = lib.llama_model_load_from_file(str(path).encode(), params)
        if not handle:
            raise DraftlabError(f"llama.cpp cannot load {path} (not a GGUF file, or an architecture this build "
                                f"of llama.cpp ({library_version()}) does not know)")
        vocab = lib.llama_model_get_vocab(handle)
        buffer = ctypes.create_string_buffer(256)
        lib.llama_model_desc(handle, buffer, len(buffer))
        from transformers import AutoConfig, GenerationConfig

        config = AutoConfig.from_pretrained(meta_dir)
        return cls(path, handle, vocab, config, GenerationConfig.from_model_config(config),
                   int(lib.llama_vocab_n_tokens(vocab)), int(lib.llama_model_n_ctx_train(handle)),
                   int(lib.llama_model_n_layer(handle)), int(lib.llama_model_n_params(handle)),
                   buffer.value.decode(errors="replace"), repack, repack_exact, meta_dir, _head_rows(lib, handle))

    def twin(self) -> "LlamaCppModel":
        """The same file loaded with repacked weights (loaded once): fast prefills for a target on exact kernels."""
        if self.repack:
            return self
        if self._twin is None:
            self._twin = LlamaCppModel.load(self.path, self.meta_dir, repack=True)
        return self._twin

    @property
    def sgemm(self) -> bool:
        """Whether the installed llama.cpp was built with llamafile's sgemm."""
        return bool(re.search(r"LLAMAFILE = 1", system_info()))

    @property
    def exact_kernels(self) -> tuple[str, ...]:
        """draftlab's kernel patches in the loaded library ('sgemm-every-row'), () for a stock build."""
        return exact_kernels()

    @property
    def rows_exact(self) -> bool:
        """Whether every row of a block rounds as the row alone on these kernels: sgemm, when built in, serves
        every row count (draftlab's patch), and weights are not repacked unless that keeps rows exact."""
        return (not self.sgemm or SGEMM_EVERY_ROW in self.exact_kernels) and (self.repack_exact or not self.repack)

    @property
    def amx(self) -> bool:
        """Whether the installed llama.cpp was built with ggml's AMX kernels (they crash on some AMX CPUs; ./run.sh
        builds without them)."""
        return bool(re.search(r"AMX_INT8 = 1", system_info()))

    @property
    def weight_type(self) -> str:
        """The file's weight type as llama.cpp names it ('Q4_1', 'Q4_K - Medium')."""
        return re.sub(r"^\S+ \S+ ", "", self.description)

    def kernels(self) -> str:
        """What the kernel settings are, for the results' record."""
        tiled = os.environ.get("GGML_CPU_TILED_MM", "default")
        sgemm = ("at every row count" if SGEMM_EVERY_ROW in self.exact_kernels else "on") if self.sgemm else "off"
        rows = "/".join(kernel.split("-")[0].upper() for kernel in (Q4_0_ROWS, Q4_K_ROWS)
                        if kernel in self.exact_kernels)
        repack = (f"on, {rows} rows in one gemv" if rows else "on") if self.repack else "off"
        return (f"llama.cpp {self.weight_type}, AMX {'on' if self.amx else 'off'}, sgemm {sgemm}, "
                f"repack {repack}, tiled MM {'off' if tiled == '0' else tiled}")

    def __del__(self) -> None:
        handle, self.handle = getattr(self, "handle", None), None
        if handle:
            llama_lib().llama_model_free(handle)


def free_native(owner) -> None:
    """Free what a llama.cpp backend holds natively (its batch, then its context), once; an object whose
    constructor failed half way holds some of them or none."""
    lib = getattr(owner, "lib", None)
    if lib is None:
        return
    if getattr(owner, "_batch", None) is not None:
        lib.llama_batch_free(owner._batch)
        owner._batch = None
    if getattr(owner, "_ctx", None):
        lib.llama_free(owner._ctx)
        owner._ctx = None


def describe_gguf(path: Path, cache_root: Path) -> Path:
    """A directory with the HF config and tokenizer read from a GGUF's metadata (no weights), made once per file.

    Keyed by the file's name, size and modification time: hashing a 1 GB file on every load would cost seconds.
    """
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()} {stat.st_size} {stat.st_mtime_ns}".encode()).hexdigest()[:16]
    out = cache_root / "gguf-meta" / key
    if (out / "config.json").exists():
        return out
    from transformers import AutoConfig, AutoTokenizer

    from draftlab.files.safeio import private_dir, publish_dir

    try:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    except Exception as exc:  # transformers raises many types for unreadable GGUF
        raise DraftlabError(f"cannot read the tokenizer and config of GGUF {path}: {exc}") from exc
    partial = private_dir(out)
    config_dict = config.to_dict()
    config_dict.pop("quantization_config", None)
    config.__class__.from_dict(config_dict).save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    (partial / "SOURCE").write_text(f"{path.name} size={stat.st_size}\n")
    return publish_dir(partial, out)
