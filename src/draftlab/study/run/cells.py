"""The grid's points and their measurements: a cell (every setting that changes a record) and one prompt's record.

The results store (`store.py`) keys its rows by `Cell.key`; the sweep builds cells from its config and the runner
fills records.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from draftlab.defaults import DEFAULT_BACKEND
from draftlab.engine import GenerationConfig
from draftlab.models import ModelSpec
from draftlab.contenders.methods import AR, method_of


LLAMACPP_TARGET = "llamacpp:"  # a target name's prefix: the target runs on llama.cpp (`--backend llamacpp` for one)


def k_words(k: int) -> str:
    """A speculative cell's K in words: K 0 is draftlab serve's K chosen each step (`--k auto`)."""
    return f"K={k}" if k else "K auto"


@dataclass(frozen=True)
class Cell:
    """One point of the grid."""

    target: str
    drafter: str  # 'none' for ar; for 'server', the speculative type (and its draft: 'draft-simple/NAME')
    k: int  # 0 for ar; for 'server', the draft length flag (0: the server's default); for 'serve', 0 is `--k auto`
    method: str  # a name of contenders.methods' table
    dataset: str
    temperature: float
    max_new_tokens: int
    seed: int = GenerationConfig.seed
    dtype: str = "fp32"  # resolved, never 'auto'
    backend: str = DEFAULT_BACKEND
    device: str = ModelSpec.device
    skip: int = 0
    concurrency: int = 1  # requests in flight (llama-server cells: the server has that many slots)

    @property
    def key(self) -> str:
        """Stable text id of the cell: every setting that changes its records (concurrency only when above 1, so
        that the keys of studies made before it existed stay valid)."""
        load = f"|c={self.concurrency}" if self.concurrency > 1 else ""
        return (f"{self.target}|{self.method}|{self.drafter}|k={self.k}|{self.dataset}|t={self.temperature}"
                f"|n={self.max_new_tokens}|seed={self.seed}|{self.dtype}|{self.backend}|{self.device}|skip={self.skip}"
                f"{load}")

    def baseline(self) -> "Cell":
        """draftlab's plain decoding on the same grid point: every cell's speedup is measured against it."""
        return replace(self, drafter="none", k=0, method=AR.name, concurrency=1)

    def engine_baseline(self) -> "Cell":
        """Plain decoding on this cell's own engine (HF's `generate` for asg, llama-cpp-python's for lcp,
        llama-server's at the same concurrency for its speculative types), whose output it must equal."""
        return replace(self, drafter="none", k=0, method=method_of(self.method).reference)


@dataclass
class Record:
    """One prompt's measurement in one cell."""

    cell: Cell
    prompt_id: str
    category: str
    new_tokens: int
    steps: int
    drafted: int
    accepted: int
    accepted_per_step: list[int] = field(default_factory=list)
    drafted_per_step: list[int] = field(default_factory=list)
    prefill_s: float = 0.0
    draft_s: float = 0.0
    target_s: float = 0.0
    overhead_s: float = 0.0
    wall_s: float = 0.0
    output_sha: str = ""
    identical: bool | None = None
    levels_per_step: list[list[int]] = field(default_factory=list)  # drafted tokens per tree level; [] for chains
    cache_held: int | None = None  # earlier responses the drafter's cross-request cache held; None: it keeps none
    window_tokens: int | None = None  # under load: new tokens of every request in flight with this one; None: alone
    latency_s: float | None = None  # under load: mean seconds from sending a request of the window to its answer
