"""The methods a study's cells run, and all the code asks of one: the one place that knows them by name.

A cell's `method` (stored in every record and cell key) names an entry of the table. Code elsewhere asks the entry
(`method_of(name)`): its contender, whether it is a plain decoding and on which engine, whether its outputs equal
plain decoding token for token or only up to rounding, its label in tables and plots, whether HF's assistant cells
apply. No module outside this one compares a method name with a string (tests/test_structure.py): a new method, a
served engine's say, is one entry here and one contender in `draftlab.contenders`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

from draftlab.errors import DraftlabError
from draftlab.measure import Contender


class ContenderSource(Protocol):
    """What builds a cell's contender (the sweep's `study.runner.CellRunner`); `cell` is a `study.cells.Cell`."""

    def speculative(self, cell: Any) -> Contender: ...  # draftlab's decoder: plain (drafter 'none') or a draft

    def plain_in(self, mode: str) -> Contender: ...  # draftlab's plain decoding in another mode (dtype, kernels)

    def hf_generate(self, cell: Any, assisted: bool) -> Contender: ...  # HF `generate`, plain or assisted

    def llama_cpp_python(self, cell: Any, lookup: bool) -> Contender: ...  # its `generate`, plain or prompt lookup

    def server(self, cell: Any, companions: tuple) -> Contender: ...  # llama-server, plain or its own speculation


@dataclass(frozen=True)
class Method:
    """One method of the study's grid."""

    name: str  # as stored in records and cell keys
    label: str  # in tables, plots and sentences
    order: int  # its place in tables: draftlab's plain decoding, other plain modes, the peers' plain, then speculation
    engine: str  # whose engine runs it, in words
    plain: bool  # a plain decoding (no speculation): what speedups are measured against
    reference: str  # the method whose output it must equal: plain decoding on its own engine (for a plain decoding:
    # draftlab's, the study's baseline)
    build: Callable[[ContenderSource, Any, tuple], Contender]  # (source, cell, companions) -> its contender
    lossless: bool = True  # False: its outputs equal plain decoding only up to rounding; never ranked with the lossless
    times_prefill: bool = True  # its contender times the prefill apart (a decode-only speedup exists)
    peer: bool = False  # another project's engine: any of its errors skips the prompt, not the study
    gguf_only: bool = False  # runs targets on llama.cpp only
    torch_only: bool = False  # runs torch targets only (HF's)
    served: bool = False  # llama-server: one server start per configuration, measured per concurrency
    assisted: bool = False  # HF assisted generation: an assistant model (AsG-style cells)
    lookup_only: bool = False  # its only draft is prompt lookup (n-gram drafters)
    swept: bool = True  # a cell per (drafter, K) of the grid; False: one cell, or made elsewhere (plain modes, servers)

    @property
    def peer_plain(self) -> bool:
        """A peer engine's own plain decoding (HF generate, llama-cpp-python's, llama-server's)."""
        return self.plain and self.peer

    @property
    def engine_plain(self) -> str | None:
        """For a peer's method, the name of that engine's plain decoding (itself for a plain one); None for
        draftlab's methods."""
        return (self.name if self.plain else self.reference) if self.peer else None

    def contender(self, source: ContenderSource, cell: Any, companions: tuple = ()) -> Contender:
        """The cell's contender for the measurement loop."""
        return self.build(source, cell, companions)

    def __str__(self) -> str:
        return self.label


AR = Method("ar", "plain decoding", 0, "draftlab", plain=True, reference="ar", swept=False,
            build=lambda source, cell, _: source.speculative(cell))
PLAIN = Method("plain", "plain decoding in another mode", 1, "draftlab", plain=True, reference="ar", swept=False,
               build=lambda source, cell, _: source.plain_in(cell.drafter))
HF = Method("hf", "HF generate", 2, "HF generate", plain=True, reference="ar", times_prefill=False, peer=True,
            torch_only=True, swept=False, build=lambda source, cell, _: source.hf_generate(cell, assisted=False))
LLAMA = Method("llama", "llama-cpp-python", 2, "llama-cpp-python", plain=True, reference="ar", times_prefill=False,
               peer=True, gguf_only=True, swept=False,
               build=lambda source, cell, _: source.llama_cpp_python(cell, lookup=False))
SERVER_AR = Method("server-ar", "llama-server", 2, "llama-server", plain=True, reference="ar", peer=True,
                   gguf_only=True, served=True, swept=False,
                   build=lambda source, cell, companions: source.server(cell, companions))
SPS = Method("sps", "SpS", 3, "draftlab", plain=False, reference="ar",
             build=lambda source, cell, _: source.speculative(cell))
ASG = Method("asg", "AsG", 4, "HF generate", plain=False, reference="hf", times_prefill=False, peer=True,
             torch_only=True, assisted=True, build=lambda source, cell, _: source.hf_generate(cell, assisted=True))
LCP = Method("lcp", "llama-cpp-python's prompt lookup", 4, "llama-cpp-python", plain=False, reference="llama",
             times_prefill=False, peer=True, gguf_only=True, lookup_only=True,
             build=lambda source, cell, _: source.llama_cpp_python(cell, lookup=True))
# llama-server's own speculation runs on kernels that round a block's rows apart from single rows: its outputs
# equal plain decoding only up to rounding, even when every one measured did.
SERVER = Method("server", "llama-server's own speculation", 4, "llama-server", plain=False, reference="server-ar",
                lossless=False, peer=True, gguf_only=True, served=True, swept=False,
                build=lambda source, cell, companions: source.server(cell, companions))
METHODS = {m.name: m for m in (AR, PLAIN, HF, LLAMA, SERVER_AR, SPS, ASG, LCP, SERVER)}
CHOICES = tuple(m.name for m in (AR, SPS, ASG, HF, LCP, LLAMA))  # --methods ('plain' follows host_baselines,
# llama-server's follow --servers)


def method_of(name: str) -> Method:
    """The method a record or cell names."""
    try:
        return METHODS[name]
    except KeyError:
        raise DraftlabError(f"unknown method {name!r}: use one of {', '.join(METHODS)}") from None


def is_baseline(name: str) -> bool:
    """Whether the method is draftlab's plain decoding, every cell's speedup reference."""
    return name == AR.name
