"""Row invariance on a device, per model shape: every row of a scored block equals the row scored alone, bitwise.

draftlab's greedy speculation is lossless only if the target scores a token the same way inside a block as plain
decoding scores it alone. Which kernel runs, and so how it rounds, depends on the device and on the model's shape
(hidden size, head size, heads), so this is checked on random weights in real models' shapes, not on the one model
at hand: op by op (the norm, the products, attention and rope, as an exact route runs them, `numerics.py`) and end
to end through the model (chains and trees after prefixes, against plain one-token decoding). `draftlab check
exact` prints it for a device; the tests run the same matrix (`tests/test_shape_matrix.py`, CPU and `-m gpu`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from draftlab.backends.fast_llama import SUPPORTED_MODEL_TYPES, FastLlamaBackend
from draftlab.backends import row_check
from draftlab.backends.numerics import INVARIANT_ROWS
from draftlab.backends.routes import parse_route
from draftlab.backends.static_step import StaticStep
from draftlab.errors import DraftlabError
from draftlab.decoding.step import Block

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TREES = {  # parents of each block row (-1: the root, the last committed token)
    "2x2": (-1, 0, 0, 1, 1, 2, 2),
    "deep": (-1, 0, 1, 1, 2, 3, 4, 5, 5),
    "dynamic": (-1, 0, 0, 0, 1, 1, 4, 2, 7, 7, 3),
}


@dataclass(frozen=True)
class Shape:
    """A model's shape: what decides which kernels run (weights are random)."""

    name: str
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    qkv_bias: bool  # Qwen2's q/k/v biases
    vocab: int
    tied: bool  # the LM head is the embedding table
    depth: int  # the model's layers (its true cost: `perf.shapes`)
    layers: int = 2  # the checks' few: the rounding of a layer does not depend on how many follow

    def capped(self, intermediate: int, vocab: int = 512) -> "Shape":
        """The shape with its MLP no wider than `intermediate` and a vocabulary of `vocab` (a CPU check's budget:
        those products are chunked like every other product; the norms and attention keep their real sizes)."""
        return replace(self, intermediate=min(self.intermediate, intermediate), vocab=min(self.vocab, vocab))


SHAPES = {s.name: s for s in (  # hidden, heads, kv heads, head size, MLP, q/k/v biases, vocabulary, tied head, depth
    Shape("smollm2-135m", 576, 9, 3, 64, 1536, False, 49152, True, 30),
    Shape("qwen2.5-0.5b", 896, 14, 2, 64, 4864, True, 151936, True, 24),
    Shape("qwen2.5-1.5b", 1536, 12, 2, 128, 8960, True, 151936, True, 28),
    Shape("qwen2.5-7b", 3584, 28, 4, 128, 18944, True, 152064, False, 28),
    Shape("llama-3-8b", 4096, 32, 8, 128, 14336, False, 128256, False, 32),
)}


@dataclass(frozen=True)
class Finding:
    """One check: which rows differed from the same rows alone (none: invariant)."""

    shape: str
    dtype: str
    what: str  # an op ('norm', 'products', 'attention', 'rope') or a block ('chain of 16 after 17', 'tree 2x2 ...')
    rows: int  # rows compared
    differing: tuple[str, ...] = ()  # e.g. 'n=7 row 0'

    @property
    def ok(self) -> bool:
        return not self.differing

    def line(self) -> str:
        verdict = "invariant" if self.ok else f"DIFFERS at {', '.join(self.differing[:4])}" + (
            f" (+{len(self.differing) - 4})" if len(self.differing) > 4 else "")
        return f"{self.shape:<14}{self.dtype:<6}{self.what:<34}{self.rows:>5} rows  {verdict}"


def random_model(shape: Shape, dtype: torch.dtype, device: str = "cpu", seed: int = 0,
                 layers: int | None = None) -> torch.nn.Module:
    """A Llama (or, with q/k/v biases, Qwen2) of `shape` (with `layers` layers instead, e.g. a whole model's for
    its true cost) with random weights, scaled like a trained model's."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    settings = dict(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                    num_hidden_layers=layers or shape.layers, num_attention_heads=shape.heads,
                    num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim, max_position_embeddings=4096,
                    tie_word_embeddings=shape.tied)
    config_class, model_class = (Qwen2Config, Qwen2ForCausalLM) if shape.qkv_bias else (LlamaConfig, LlamaForCausalLM)
    torch.manual_seed(seed)
    with torch.device(device):
        model = model_class(config_class(**settings))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:  # trained norms are not all ones: give each row's scale its own rounding
                param.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.5)
    return model.to(dtype).eval().requires_grad_(False)


def check_ops(backend: FastLlamaBackend, shape: Shape, dtype_name: str, seed: int = 0) -> list[Finding]:
    """The norm, the products, attention and rope of the backend's exact route, each row of blocks of 1 to 16 rows
    against the same row alone (`row_check.check_ops`)."""
    found = row_check.check_ops(backend.block_ops, shape.hidden, shape.heads, shape.kv_heads, shape.head_dim,
                                backend.device, backend.dtype, seed)
    return [Finding(shape.name, dtype_name, f.what, f.rows, f.differing) for f in found]


def check_model(backend: FastLlamaBackend, shape: Shape, dtype: str, prefixes: tuple[int, ...],
                chains: tuple[int, ...] = (16,), trees: tuple[str, ...] = tuple(TREES)) -> list[Finding]:
    """End to end: every row of chain blocks (each length of `chains`) and of `trees`, scored after each prefix
    length, against plain decoding (the prefix prefilled, then one token at a time along the row's path)."""
    findings = []
    for prefix_len in prefixes:
        prefix = [(31 * i + 7) % shape.vocab for i in range(prefix_len)]
        tokens = [(13 * i + 5) % shape.vocab for i in range(16)]
        blocks = [(f"chain of {n} after {prefix_len}", Block.chain(tokens[:n])) for n in chains]
        blocks += [(f"tree {name} after {prefix_len}", Block(tokens[: len(parents)], parents))
                   for name, parents in ((t, TREES[t]) for t in trees)]
        for what, block in blocks:
            differing = _block_rows_differ(backend, prefix, block)
            findings.append(Finding(shape.name, dtype, what, len(block.tokens), differing))
    return findings


def _block_rows_differ(backend: FastLlamaBackend, prefix: list[int], block: Block) -> tuple[str, ...]:
    """Rows of `block` (scored after `prefix`) that differ from plain decoding of their path."""
    backend.reset()
    backend.score(prefix, last_only=True)
    scored = backend.score_block(block).logits  # [n, V]
    plain = _plain_rows(backend, prefix, block)
    return tuple(f"row {i}" for i in range(len(block.tokens)) if not torch.equal(scored[i], plain[i]))


def _plain_rows(backend: FastLlamaBackend, prefix: list[int], block: Block) -> list[torch.Tensor]:
    """Each block row's logits [V] as plain decoding gives them: the prefix prefilled, then the row's path one token
    at a time (depth first over the tree, rolling back between branches)."""
    backend.reset()
    backend.score(prefix, last_only=True)
    children: dict[int, list[int]] = {}
    for node, parent in enumerate(block.parents):
        children.setdefault(parent, []).append(node)
    rows: dict[int, torch.Tensor] = {}

    def visit(node: int) -> None:
        length = backend.cache_len
        rows[node] = backend.score([block.tokens[node]])[0]
        for child in children.get(node, []):
            visit(child)
        backend.rollback(length)

    for root in children[-1]:
        visit(root)
    return [rows[i] for i in range(len(block.tokens))]


def check_shape(shape: Shape, dtype: str, device: str, prefixes: tuple[int, ...], chains: tuple[int, ...] = (16,),
                trees: tuple[str, ...] = tuple(TREES), rows: int = INVARIANT_ROWS,
                step: StaticStep | str | None = "auto", route: str = "exact-linear") -> list[Finding]:
    """Op by op and end to end for one shape and dtype on a device, on the exact route `route`/`rows` (exact-linear
    or exact-wm), its blocks run as `step` says (`FastLlamaBackend`; 'auto': the device's default)."""
    model = random_model(shape, DTYPES[dtype], device)
    backend = FastLlamaBackend(model, device, capacity=max(prefixes) + 64, route=parse_route(f"{dtype} {route}/{rows}"),
                               step=step)
    return check_ops(backend, shape, dtype) + check_model(backend, shape, dtype, prefixes, chains, trees)


def shapes_named(names: list[str] | None) -> list[Shape]:
    """The shapes a user named (all when none): short names, or a model's `config.json` (or its folder); anything
    else is refused with the known names."""
    if not names:
        return list(SHAPES.values())
    unknown = [n for n in names if n not in SHAPES and not _config_file(n).is_file()]
    if unknown:
        raise DraftlabError(f"unknown shape(s) {unknown}; known: {', '.join(SHAPES)}, or a model's config.json")
    return [SHAPES[n] if n in SHAPES else shape_of_config(_config_file(n)) for n in names]


def _config_file(name: str) -> Path:
    path = Path(name)
    return path / "config.json" if path.is_dir() else path


def shape_of_config(path: Path) -> Shape:
    """The shape a Hugging Face `config.json` describes (a Llama or a Qwen2: what draftlab's engine runs), named
    after its folder; one clear line for a file that is not such a config."""
    try:
        config = json.loads(path.read_text())
        model_type = config["model_type"]
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise DraftlabError(f"{path}: model_type {model_type!r}; a shape must be one of {SUPPORTED_MODEL_TYPES}")
        heads, hidden = int(config["num_attention_heads"]), int(config["hidden_size"])
        name = path.resolve().parent.name if path.name == "config.json" else path.stem
        return Shape(name, hidden, heads,
                     int(config.get("num_key_value_heads") or heads), int(config.get("head_dim") or hidden // heads),
                     int(config["intermediate_size"]), model_type == "qwen2", int(config["vocab_size"]),
                     bool(config.get("tie_word_embeddings", False)), int(config["num_hidden_layers"]))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:  # not UTF-8, not JSON, not a config
        raise DraftlabError(f"{path} is not a model's config.json ({type(exc).__name__}: "
                            f"{str(exc).splitlines()[0][:120] if str(exc) else ''})") from exc
