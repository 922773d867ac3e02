"""One cell's aggregates (`CellSummary`) and the words that name its engine and its plain decoding."""

from __future__ import annotations

from dataclasses import dataclass, field

from draftlab.backends import engine_of_backend
from draftlab.contenders.methods import HF, LLAMA, PLAIN, method_of
from draftlab.study.run.cells import LLAMACPP_TARGET

ALL = "all"


@dataclass
class CellSummary:
    """Aggregates of one cell (or of one configuration over all datasets, dataset='all')."""

    target: str
    method: str
    drafter: str
    k: int
    dataset: str
    temperature: float
    prompts: int
    new_tokens: int
    wall_s: float
    tokens_per_s: float
    ms_per_token: float
    tokens_per_step: float | None  # TAR; None for asg (HF does not report steps)
    acceptance_rate: float | None
    draft_ms_per_step: float | None
    target_ms_per_step: float | None
    overhead_ms_per_step: float | None
    speedup: float = 0.0  # decode (`draftlab.measure.DECODE`; end to end for records that timed no prefill apart)
    # over draftlab's plain decoding (the ar cell) re-timed closest in time on each prompt: paired ratios
    decode_speedup: float | None = None  # decode only over the ar record's decoding; None for a peer library's
    # cells in studies whose records timed no prefill apart
    speedup_low: float = 0.0  # the speedup's 95% interval over the prompts' paired ratios (t on their logs)
    speedup_high: float = 0.0
    speedup_min: float = 0.0
    speedup_median: float = 0.0
    speedup_max: float = 0.0
    identical: int | None = None  # outputs equal to plain decoding on the cell's own engine (greedy only)
    per_position_acceptance: list[float] = field(default_factory=list)
    engine_plain_tokens_per_s: float | None = None  # plain decoding on this cell's engine (HF generate for asg)
    engine_speedup: float | None = None  # over that engine's own plain decoding on the same prompts
    host_speedup: float | None = None  # over the fastest plain decoding measured on the host (any dtype or route)
    host_plain: str = ""  # which plain decoding that was ('ar': the study's own, else `plain_label`)
    host_engine: str = ""  # the engine it ran on, in words (`engine_words`)
    host_low: float = 0.0  # host_speedup's 95% interval over the prompts both ran (`draftlab.study.answer.host`)
    host_high: float = 0.0
    host_reference: bool = False  # this cell is the plain decoding its model's cells are judged against
    backend: str = ""  # the backend its records ran on ('llamacpp', 'fast', 'auto', ...)
    complete: bool = True  # ran every prompt its group ran (False: dropped by the race, or skipped prompts)
    decode_tokens_per_s: float | None = None  # new tokens over the time after each prefill; None when the cell's
    # library times no prefill apart
    prefill_s: float | None = None  # mean seconds of prefill a prompt; None likewise

    @property
    def lossy(self) -> bool:
        """True when some greedy output differed from plain decoding on the cell's own engine."""
        return self.identical is not None and self.identical < self.prompts

    @property
    def rounding(self) -> bool:
        """True for speculation whose outputs equal plain decoding only up to rounding (llama-server's own, on
        kernels that round a block's rows apart from single rows), however many of them were identical."""
        return not method_of(self.method).exact

    @property
    def config_key(self) -> tuple:
        return (self.target, self.method, self.drafter, self.k, self.temperature)


MIN_INTERVAL_PROMPTS = 4  # fewer paired prompts give no interval worth printing


def interval_words(low: float, high: float, prompts: int, sep: str = "-") -> str:
    """A paired 95% interval as printed: '1.02-1.27', or 'n prompts: too few for an interval' where fewer than
    `MIN_INTERVAL_PROMPTS` prompts were paired (t over 1-2 degrees of freedom spans orders of magnitude)."""
    if prompts < MIN_INTERVAL_PROMPTS:
        return f"{prompts} prompt{'s' if prompts != 1 else ''}: too few for an interval"
    return f"{low:.2f}{sep}{high:.2f}"


def pace(s: CellSummary) -> float:
    """A cell's decode tokens/s (its end-to-end tokens/s where no prefill was timed apart)."""
    return s.decode_tokens_per_s or s.tokens_per_s


def plain_label(s: CellSummary) -> str:
    """Which plain decoding a plain cell is, in words: a route or mode label, or another engine's."""
    method = method_of(s.method)
    return s.drafter if method is PLAIN else method.engine if method.peer_plain else method.name


def engine_words(s: CellSummary) -> str:
    """The engine a cell ran on, in words."""
    method = method_of(s.method)
    if method.served:
        return method.engine
    if method.engine == LLAMA.engine:
        return "llama.cpp (llama-cpp-python)"
    if engine_of_backend(s.backend).runs_gguf or s.target.startswith(LLAMACPP_TARGET) or s.drafter.startswith("llama.cpp"):
        return "llama.cpp (draftlab)"
    if method.engine == HF.engine:
        return "HF transformers"
    return f"draftlab's torch backend ({s.drafter})" if method is PLAIN else "draftlab's torch backend"
