"""Depth vs width: per-token decode latency of random-weight models shaped like the target.

The second study's Figure 4, in the target's own architecture family and on
the current device:
  (a) fixed non-embedding parameter count, depth traded for width;
  (b) fixed width (the target's), growing depth;
  (c) fixed depth, growing width.
Weights are random (latency does not depend on their values). Each shape is
timed through draftlab's own backend: prefill a context, then the median
time of single-token steps, rolled back so the context length stays fixed.
"""

from __future__ import annotations

import copy
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from draftlab.backends import make_backend
from draftlab.files.safeio import write_atomic
from draftlab.progress import track


@dataclass(frozen=True)
class Shape:
    """One model shape: layers, hidden size, heads and MLP size."""

    series: str  # fixed_params | fixed_width | fixed_depth
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int


@dataclass(frozen=True)
class Timing:
    """Per-token latency of one shape."""

    shape: Shape
    params_millions: float  # without the embedding / LM head
    ms_per_token: float


def _round(x: float, multiple: int) -> int:
    return max(multiple, int(round(x / multiple)) * multiple)


def shapes_for(config) -> list[Shape]:
    """The three series, scaled from the target's config."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    group = config.num_attention_heads // config.num_key_value_heads
    mlp_ratio = config.intermediate_size / config.hidden_size
    depth = config.num_hidden_layers

    def shape(series, layers, hidden, layer_params=None):
        heads = max(group, _round(hidden / head_dim, group))
        hidden = heads * head_dim
        kv = heads // group
        attention = 2 * hidden * hidden + 2 * hidden * kv * head_dim  # q, o and k, v projections
        if layer_params is None:
            intermediate = _round(hidden * mlp_ratio, 64)
        else:  # fill the layer's parameter budget with the MLP, so the total stays fixed
            intermediate = _round(max(layer_params - attention, 3 * hidden * 64) / (3 * hidden), 64)
        return Shape(series, layers, hidden, heads, kv, intermediate)

    target_layer = shape("target", 1, config.hidden_size)
    per_layer = 2 * target_layer.hidden ** 2 + 2 * target_layer.hidden * target_layer.kv_heads * head_dim \
        + 3 * target_layer.hidden * target_layer.intermediate
    budget = per_layer * depth
    fixed_params = [shape("fixed_params", n, config.hidden_size * (depth / n) ** 0.5, budget / n)
                    for n in sorted({depth, depth * 2 // 3, depth // 2, depth // 3, depth // 5, 4, 2}, reverse=True) if n >= 1]
    fixed_width = [shape("fixed_width", n, config.hidden_size) for n in sorted({1, 2, 4, 8, 16, depth})]
    fixed_depth = [shape("fixed_depth", 4, config.hidden_size * f) for f in (0.5, 1, 1.5, 2, 3, 4)]
    return fixed_params + fixed_width + fixed_depth


def build(config, shape: Shape) -> torch.nn.Module:
    """A random-weight model of `shape` in the target's family (a new config; the target's is untouched)."""
    from transformers import AutoModelForCausalLM

    new = copy.deepcopy(config)
    new.num_hidden_layers = shape.layers
    new.hidden_size = shape.hidden
    new.num_attention_heads = shape.heads
    new.num_key_value_heads = shape.kv_heads
    new.intermediate_size = shape.intermediate
    new.head_dim = shape.hidden // shape.heads
    if getattr(new, "layer_types", None) is not None:
        new.layer_types = [config.layer_types[i % len(config.layer_types)] for i in range(shape.layers)]
    return AutoModelForCausalLM.from_config(new).eval()


def time_shape(model: torch.nn.Module, context: int = 128, steps: int = 20) -> float:
    """Median seconds of one decode step at a fixed context length."""
    backend = make_backend(model)
    backend.reset()
    vocab = model.config.vocab_size
    backend.score([1 + i % (vocab - 1) for i in range(context)], last_only=True)  # any ids the vocabulary holds
    times = []
    for i in range(steps + 2):
        start = time.perf_counter()
        backend.score([7])
        backend.synchronize()
        times.append(time.perf_counter() - start)
        backend.rollback(context)
    return statistics.median(times[2:])


def run(config, context: int = 128, steps: int = 20, progress: bool = True,
        series: tuple[str, ...] = ("fixed_params", "fixed_width", "fixed_depth")) -> list[Timing]:
    """Time every shape of `series`."""
    out = []
    shapes = [shape for shape in shapes_for(config) if shape.series in series]
    for shape in track(shapes, "microbench", unit="shape", disable=not progress):
        model = build(config, shape)
        params = sum(p.numel() for n, p in model.named_parameters() if "layers." in n) / 1e6
        out.append(Timing(shape, params, 1000 * time_shape(model, context, steps)))
        del model
    return out


def plot(timings: list[Timing], out: Path) -> list[Path]:
    """One PNG per series: latency against the varied dimension."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for series, x_of, xlabel, title in (
        ("fixed_params", lambda s: s.layers, "layers (width grows as depth shrinks)", "(a) fixed parameters: depth vs width"),
        ("fixed_width", lambda s: s.layers, "layers (width fixed)", "(b) fixed width, growing depth"),
        ("fixed_depth", lambda s: s.hidden, "hidden size (4 layers)", "(c) fixed depth, growing width"),
    ):
        points = [t for t in timings if t.shape.series == series]
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot([x_of(t.shape) for t in points], [t.ms_per_token for t in points], "o-")
        for t in points:
            ax.annotate(f"{t.params_millions:.0f}M", (x_of(t.shape), t.ms_per_token), fontsize=7,
                        xytext=(3, 3), textcoords="offset points")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("decode latency (ms per token)")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = out / f"microbench_{series}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def save(timings: list[Timing], out: Path) -> Path:
    """Timings as JSON (`out`/microbench.json, written atomically)."""
    path = out / "microbench.json"
    write_atomic(path, json.dumps([timing_row(t) for t in timings], indent=2))
    return path


def timing_row(timing: Timing) -> dict:
    """One timing as a row of microbench.json: its shape's fields, its parameters and latency."""
    return {**asdict(timing.shape), "params_millions": timing.params_millions, "ms_per_token": timing.ms_per_token}


def format_table(timings: list[Timing]) -> str:
    """The timings for people."""
    lines = [f"{'series':<14}{'layers':>7}{'hidden':>8}{'heads':>6}{'mlp':>7}{'params(M)':>11}{'ms/token':>10}"]
    for t in timings:
        s = t.shape
        lines.append(f"{s.series:<14}{s.layers:>7}{s.hidden:>8}{s.heads:>6}{s.intermediate:>7}"
                     f"{t.params_millions:>11.1f}{t.ms_per_token:>10.2f}")
    return "\n".join(lines)
