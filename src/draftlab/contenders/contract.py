"""The contract between the study and an engine it races: a method (what a cell runs) and what its contender may ask
of the sweep.

An engine the study races is one entry of `draftlab.backends.engines` (its `methods_from` names a module) and that
module, whose `METHODS` tuple lists the engine's methods: its plain decoding and its own speculation. Each method
builds its cell's contender from a `ContenderSource`, which owns the target and what is built once per target.
`draftlab.contenders.methods` gathers the methods of every entry; nothing else names an engine's methods.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol, TypeVar

from draftlab.errors import DraftlabError
from draftlab.measure import Contender, InFlight

if TYPE_CHECKING:
    from draftlab.api import SpeculativeDecoder
    from draftlab.models import LoadedModel

T = TypeVar("T")


class Servers(Protocol):
    """Where served engines' cells get their servers: started on first use (`config.server(log_dir)`), stopped by
    the sweep however it ends (`contenders.server_configs.ServerPool`)."""

    most_in_flight: int  # the most requests a cell sends at once
    most_k: int  # the grid's longest K (0: every cell's server at its own K)

    def contender(self, config: Any, reuse: bool = True) -> Contender: ...  # the server of a configuration


class ContenderSource(Protocol):
    """What builds a cell's contender (the sweep's `study.run.runner.CellRunner`); `cell` is a
    `study.run.cells.Cell`."""

    target: "LoadedModel"  # the cell's target, loaded once
    eos: tuple[int, ...]  # its end-of-sequence token ids
    servers: Servers | None  # where served engines' cells get their servers

    def cell_decoder(self, cell: Any) -> "SpeculativeDecoder": ...  # draftlab's decoder: plain or the cell's draft

    def decoder(self, drafter: str, k: int) -> "SpeculativeDecoder": ...  # draftlab's decoder of a drafter at K

    def plain_in(self, mode: str) -> "SpeculativeDecoder": ...  # draftlab's plain decoding in another mode

    def shared(self, name: str, build: Callable[[], T]) -> T: ...  # one object per target and name, built on first use


@dataclass(frozen=True)
class Method:
    """One method of the study's grid: plain decoding or one speculative method, on one engine."""

    name: str  # as stored in records and cell keys
    label: str  # in tables, plots and sentences
    order: int  # its place in tables: draftlab's plain decoding, other plain modes, the peers' plain, then speculation
    engine: str  # whose engine runs it, in words
    plain: bool  # a plain decoding (no speculation): what speedups are measured against
    reference: str  # the method whose output it must equal: plain decoding on its own engine (for a plain decoding:
    # draftlab's, the study's baseline)
    build: Callable[[ContenderSource, Any, tuple], Contender]  # (source, cell, companions) -> its contender
    lossless: bool = True  # False: its outputs equal plain decoding only up to rounding; never ranked with the lossless
    lossless_here: Callable[[], bool] | None = None  # a method lossless on some builds only: whether this host's is one
    times_prefill: bool = True  # its contender times the prefill apart (a decode-only speedup exists)
    peer: bool = False  # another project's engine: any of its errors skips the prompt, not the study
    gguf_only: bool = False  # runs targets on llama.cpp only
    torch_only: bool = False  # runs torch targets only (HF's)
    served: bool = False  # a server: one server start per configuration, measured per concurrency
    assisted: bool = False  # HF assisted generation: an assistant model (AsG-style cells)
    takes: Callable[[str], bool] | None = None  # the drafters it runs (None: every one of the grid)
    missing: Callable[[], str] | None = None  # why it cannot run here ('' when it can; None: it always can)
    swept: bool = True  # a cell per (drafter, K) of the grid; False: one cell, or made elsewhere (plain modes, servers)
    chosen: bool = True  # named by `--methods`; False: it follows another option (plain modes, servers)

    @property
    def peer_plain(self) -> bool:
        """A peer engine's own plain decoding (HF generate, llama-cpp-python's, llama-server's)."""
        return self.plain and self.peer

    @property
    def engine_plain(self) -> str | None:
        """For a peer's method, the name of that engine's plain decoding (itself for a plain one); None for
        draftlab's methods."""
        return (self.name if self.plain else self.reference) if self.peer else None

    @property
    def exact(self) -> bool:
        """Whether its outputs equal plain decoding bitwise here (ranked with the lossless): always, or on this
        host's build (`lossless_here`: llama-server built on draftlab's exact kernels)."""
        return self.lossless or (self.lossless_here is not None and self.lossless_here())

    def runs(self, drafter: str) -> bool:
        """Whether it has a cell for this drafter of the grid."""
        return self.takes is None or self.takes(drafter)

    def contender(self, source: ContenderSource, cell: Any, companions: tuple = ()) -> Contender:
        """The cell's contender for the measurement loop."""
        return self.build(source, cell, companions)

    def __str__(self) -> str:
        return self.label


def served_contender(source: ContenderSource, cell: Any, companions: tuple, config: Any,
                     per_cell: Callable[[Contender], Contender] | None = None) -> Contender:
    """The server of a served cell's configuration (`per_cell`: what the cell's requests add to the server's
    contender, where cells share a server); with more than one request in flight, timed with its companions (alone,
    without any: the warm-up)."""
    if source.servers is None:
        raise DraftlabError("this sweep runs no server cells")
    adapt = per_cell or (lambda contender: contender)
    if cell.concurrency > 1 and companions:
        return InFlight(adapt(source.servers.contender(config, reuse=False)), companions[:cell.concurrency - 1])
    return adapt(source.servers.contender(config))
