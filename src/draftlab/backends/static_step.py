"""The static step: the exact route's scored blocks as passes of fixed shapes, replayed as CUDA graphs on a GPU.

On a GPU, one token of a Llama runs about 30 small kernels a layer; launched one by one from Python they cost more
than the weights take to read (18-26 ms a token on an H200 whatever the model's size). A CUDA graph records a pass's
kernels once and replays them in one launch, which needs a pass whose every tensor has a fixed address and shape:

- the block's inputs (token ids, rope positions, cache slots, the visible-keys mask) live in buffers of the graph,
  filled before each replay;
- the cache is written at its slots by an indexed copy, and attention runs over the whole cache with the keys a
  row does not see masked out (`attention.MaskedAttention`), so nothing depends on the cache's length;
- one graph per block size (and taps), captured at its first use and dropped when the cache grows.

The step's numerics are its own: attention over the masked whole cache rounds apart from attention over the seen
keys only (the eager step), so a backend runs every scored block of every size through it, plain decoding's single
tokens too, and names it in its numerics. Rows stay exact either way: every row runs the same calls alone or in a
block. With `graphs` off (the CPU) the same passes run eagerly: CI checks the step's shape logic and exactness on
the CPU, and a GPU replays bitwise what it would run eagerly (`draftlab check exact --device cuda` checks both).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from draftlab.backends.attention import ATTENTION_MODES
from draftlab.errors import DraftlabError

CAPACITY_STEP = 64  # a static cache's capacity is a multiple of this (aligned mask rows for the attention kernels)


@dataclass(frozen=True)
class StaticStep:
    """How a backend runs its scored blocks as static passes."""

    graphs: bool  # replay each block size as a CUDA graph (CUDA only)
    attention: str  # 'rows': one attention call per row; 'block': one call for the block (`attention.py`)

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION_MODES:
            raise DraftlabError(f"attention {self.attention!r}: one of {', '.join(ATTENTION_MODES)}")

    @property
    def label(self) -> str:
        """For the numerics: 'static cache, CUDA graphs, attention by rows'."""
        return (f"static cache{', CUDA graphs' if self.graphs else ''}, attention "
                f"{'by rows' if self.attention == 'rows' else 'in one call'}")

    @classmethod
    def parse(cls, text: str) -> "StaticStep | None":
        """'off' (the eager step), 'rows', 'block' (static passes run eagerly), 'graphs' (CUDA graphs, attention by
        rows), 'graphs-block' (CUDA graphs, a chain's attention in one call: CUDA's default)."""
        choices = {"off": None, "rows": cls(False, "rows"), "block": cls(False, "block"),
                   "graphs": cls(True, "rows"), "graphs-block": cls(True, "block")}
        if text not in choices:
            raise DraftlabError(f"step {text!r}: one of {', '.join(choices)}")
        return choices[text]


def default_step(device: torch.device) -> StaticStep | None:
    """CUDA: graphs, a chain's attention in one call (a block of 8 cost 1.10x one token on an H200 in the 7B shape,
    by rows 1.75x; every row invariant in `draftlab check exact` for five shapes in fp32, bf16 and fp16 there);
    elsewhere the eager step (None), which on a CPU attends over the seen keys only, the cheaper pass there."""
    return StaticStep(True, "block") if device.type == "cuda" else None


@dataclass
class StepInputs:
    """One scored block's inputs, on the backend's device."""

    ids: torch.Tensor  # [m] long: the block's n rows, then padding rows up to the route's R (m = max(n, R))
    positions: torch.Tensor  # [m] long: rope positions (a tree row's depth after the cache)
    slots: torch.Tensor  # [m] long: the cache entries the rows are written to (padding rows: the last, never seen)
    bias: torch.Tensor  # [m, capacity] additive mask (0 seen, -inf not), over each row's keys in order
    rows: int  # n: the block's own rows
    order: torch.Tensor | None  # [n, capacity] long: a tree's rows' keys (`attention.key_order`); None: a chain

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(t for t in (self.ids, self.positions, self.slots, self.bias, self.order) if t is not None)

    def to(self, device: torch.device) -> "StepInputs":
        ids, positions, slots, bias = (t.to(device) for t in (self.ids, self.positions, self.slots, self.bias))
        return StepInputs(ids, positions, slots, bias, self.rows, None if self.order is None else self.order.to(device))

    def copy_(self, other: "StepInputs") -> None:
        for mine, theirs in zip(self.tensors(), other.tensors()):
            mine.copy_(theirs, non_blocking=True)

    def clone(self) -> "StepInputs":
        return StepInputs(self.ids.clone(), self.positions.clone(), self.slots.clone(), self.bias.clone(), self.rows,
                          None if self.order is None else self.order.clone())


Outputs = tuple[torch.Tensor, ...]
Pass = Callable[[StepInputs, tuple[int, ...]], Outputs]


class StepGraphs:
    """A pass recorded as one CUDA graph per (block size, taps), replayed on new inputs."""

    def __init__(self, run: Pass, device: torch.device) -> None:
        self.run, self.device = run, device
        self._graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, StepInputs, Outputs]] = {}
        self._pool = None

    def __call__(self, inputs: StepInputs, taps: tuple[int, ...]) -> Outputs:
        """The pass's outputs on `inputs`; clones, so that the next replay does not overwrite them."""
        key = (inputs.ids.shape[0], inputs.rows, inputs.bias.shape[1], inputs.order is None, taps)
        if key not in self._graphs:
            self._graphs[key] = self._capture(inputs, taps)
            return tuple(out.clone() for out in self._graphs[key][2])  # the capture's own pass computed them
        graph, static, outputs = self._graphs[key]
        static.copy_(inputs)
        graph.replay()
        return tuple(out.clone() for out in outputs)

    def clear(self) -> None:
        """Drop every graph (the cache they write was reallocated)."""
        self._graphs.clear()

    def _capture(self, inputs: StepInputs, taps: tuple[int, ...]):
        """Warm the pass up on a side stream (lazy kernel and library set-up must not be recorded), then record it;
        the recording itself runs nothing, so the pass is replayed once for these inputs."""
        static = inputs.clone()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self.run(static, taps)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self._pool):
            outputs = self.run(static, taps)
        graph.replay()
        return graph, static, outputs
