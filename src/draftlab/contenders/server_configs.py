"""llama-server configurations by name: how a study or the tuner names one, which server runs it, and its command.

A study (or `draftlab tune --servers`) lists llama-server's own speculative types as `TYPE[/DRAFT][:K,...[:P,...]]`
(`SweepConfig.servers`): `ngram-mod`, `ngram-simple:16,64`, `draft-simple/qwen2.5-coder-0.5b:3,4`,
`draft-simple/qwen2.5-coder-0.5b:4:0.5,0.8` (P: `--spec-draft-p-min`, for draft models),
`draft-simple,ngram-mod/qwen2.5-coder-0.5b`, `draft-eagle3/DIR:3` (an EAGLE-3 draft directory holding the GGUF
`draftlab design eagle3 --gguf` wrote, or that GGUF's path). Each (K, P) becomes a 'server' cell (K 0, or none
given: the server's default length; a P shows in the drafter label as `,p=P`); each concurrency level of the study
gives every configuration, and the server's plain decoding ('server-ar'), a server with that many slots. K is the
length flag of the type: `--spec-draft-n-max` for draft models and the n-gram map types, `--spec-ngram-mod-n-max`
for `ngram-mod` (with its `-n-min` at three quarters of it, the ratio of the server's defaults, 48 of 64).

`ServerPool` starts each configuration's server the first time a cell needs it, keeps it for the study's other
prompts (per-request speculative settings are compiled out of this llama.cpp: a configuration is a server start)
as long as the host's memory holds them all (else the cells of a prompt run in groups that fit, `in_groups`, and a
server not held is stopped to make room and started again when next used) and stops them all when the study ends,
however it ends. Servers that differ only in their n-gram speculation
prefill a prompt once: one computes it, the others load its slot file (`PrefillShare`).

Its `METHODS` in a study (`contenders.contract`): llama-server's plain decoding and its own speculation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence, TypeVar

from draftlab.contenders.contract import ContenderSource, Method, served_contender
from draftlab.contenders.served import PrefillShare, available_gib
from draftlab.errors import DraftlabError
from draftlab.contenders.llama_server import ServerConfig, exact_server, server_binary
from draftlab.deploy import SPEC_TYPES, length_flags
from draftlab.measure import Contender
from draftlab.models import gguf_path
from draftlab.drafters.eagle3_checkpoint import engine_files
from draftlab.drafters.kinds import is_plain_drafter

T = TypeVar("T")
CONTEXT_PER_SLOT = 4096  # tokens of context each slot gets: the longest shipped prompt plus its answer fits
MAX_CONCURRENCY = 16  # load runs go to 127.0.0.1 only, bounded: each level is that many requests at once


@dataclass(frozen=True)
class ServerSpec:
    """One speculative type of llama-server (or a comma list), its draft model if any, and the lengths (and, for
    draft models, the minimum draft probabilities) to run."""

    spec_type: str
    draft: str = ""  # a draft GGUF's short name or path, for the draft-* types
    ks: tuple[int, ...] = ()  # draft length flag values (0: the server's default); (): none given
    p_mins: tuple[float | None, ...] = (None,)  # --spec-draft-p-min values; None: the server's default

    @property
    def drafter(self) -> str:
        """The type, and its draft after a slash."""
        return f"{self.spec_type}/{self.draft}" if self.draft else self.spec_type

    def configurations(self, ks: tuple[int, ...] = (0,)) -> list[tuple[str, int]]:
        """(drafter label, K) of every configuration: the label carries the draft and its P (`,p=P`); `ks`: the
        lengths where the spec names none (a study's K, so the server's types race at draftlab's lengths)."""
        return [(self.drafter + (f",p={p:g}" if p is not None else ""), k) for p in self.p_mins
                for k in self.ks or ks]


def parse_server_spec(text: str) -> ServerSpec:
    """`TYPE[/DRAFT][:K,...[:P,...]]` -> its spec; a one-line error naming what is wrong."""
    head, _, rest = text.partition(":")
    lengths, _, probabilities = rest.partition(":")
    spec_type, _, draft = head.partition("/")
    types = [t for t in spec_type.split(",") if t]
    unknown = [t for t in types if t not in SPEC_TYPES]
    if not types or unknown:
        raise DraftlabError(f"unknown llama-server speculative type {(unknown or [text])[0]!r} in {text!r}; use one of "
                            f"{', '.join(SPEC_TYPES)}, as TYPE[/DRAFT][:K,...[:P,...]]")
    needs_draft = any(t.startswith("draft-") for t in types)
    if needs_draft != bool(draft):
        raise DraftlabError(f"{text!r}: the draft-* types take a draft model (TYPE/DRAFT), the n-gram types none")
    try:
        ks = tuple(int(k) for k in lengths.split(",")) if lengths else ()
        p_mins = tuple(float(p) for p in probabilities.split(",")) if probabilities else (None,)
    except ValueError:
        raise DraftlabError(f"{text!r}: give whole lengths and probabilities, e.g. ngram-mod:16,64 or "
                            "draft-simple/DRAFT:4:0.5,0.8") from None
    if min(ks, default=0) < 0:
        raise DraftlabError(f"{text!r}: a draft length must be >= 0 (0: the server's default)")
    if probabilities and (not needs_draft or not all(0.0 <= p <= 1.0 for p in p_mins)):
        raise DraftlabError(f"{text!r}: a minimum draft probability (after the second ':') is for draft models and "
                            "lies in [0, 1]")
    return ServerSpec(spec_type, draft, ks, p_mins)


def check_concurrency(levels: tuple[int, ...]) -> None:
    """Concurrency levels are whole numbers from 1 to MAX_CONCURRENCY."""
    if not levels or min(levels) < 1 or max(levels) > MAX_CONCURRENCY:
        raise DraftlabError(f"concurrency levels must be 1 to {MAX_CONCURRENCY}, got {list(levels)}")


def spec_config(model: Path, drafter: str, k: int, slots: int = 1) -> ServerConfig:
    """The server of one configuration: the target's GGUF, the drafter label's type and draft ('none': plain
    decoding), length K, `slots` requests at once."""
    if is_plain_drafter(drafter):
        return ServerConfig(model, slots=slots, context=CONTEXT_PER_SLOT * slots)
    spec_type, _, draft = drafter.partition("/")
    draft, _, p_min = draft.partition(",p=")
    n_max, extra = length_flags(spec_type, k)
    return ServerConfig(model, spec_type, draft_gguf(spec_type, draft) if draft else None, draft_n_max=n_max,
                        draft_p_min=float(p_min) if p_min else None, slots=slots, context=CONTEXT_PER_SLOT * slots,
                        extra=extra)


def draft_gguf(spec_type: str, draft: str) -> Path:
    """The GGUF a draft-* type loads: a short name or a .gguf path; for draft-eagle3 also an EAGLE-3 draft
    directory (its eagle3-draft.gguf, which `draftlab design eagle3 --gguf` writes there)."""
    directory = Path(draft).expanduser()
    if spec_type != "draft-eagle3" or not directory.is_dir():
        return gguf_path(draft)
    gguf = engine_files(directory)[1]
    if not gguf.is_file():
        raise DraftlabError(f"{draft} holds no {gguf.name}: write it with `draftlab design eagle3 --from {draft} "
                            f"--out {draft} --gguf`")
    return gguf


MEMORY_MARGIN_GIB = 1.5  # what a server start leaves the host: the study's own process grows as it runs


class NoRoom(DraftlabError):
    """A server that does not fit in the host's memory beside those the work in progress holds."""


@dataclass
class ServerPool:
    """The study's running servers (llama-server's, draftlab serve's, vLLM's), one per configuration, started on first
    use and stopped by `stop_all`. A configuration makes its own server: `config.server(log_dir)`. Servers the work
    in progress holds (each `contender` since the last `let_go`) keep running; where another would not fit in the
    host's memory (judged by what the largest running server of its kind holds), the others are stopped to make room,
    the one used last first (a sweep uses them in turn: the one it used last it needs last again), and started again
    when next used; where none can be stopped, `NoRoom` says so in one line."""

    log_dir: Path
    most_in_flight: int = 1  # the most requests any cell sends at once (a vLLM server serves every level)
    most_k: int = 0  # the grid's longest K: a draftlab serve server at it serves a drafter's every K (0: one per K)
    running: dict = field(default_factory=dict)  # configuration -> (its running server, its PrefillShare or None),
    # the one used last at the end
    shares: dict = field(default_factory=dict)  # prefill group -> its PrefillShare
    held: set = field(default_factory=set)  # configurations the work in progress holds
    stopped_for_room: int = 0  # servers stopped to make room for another
    starts: int = 0  # servers started (again, where one was stopped to make room)
    most_running: int = 0  # the most servers that ran at once

    def contender(self, config, reuse: bool = True) -> Contender:
        """The contender of a configuration's server, started if it is not running (others stopped to make room);
        `reuse`: its requests start from the prompt's prefill, which the servers of one prefill group compute once
        (`PrefillShare`). The server is held until `let_go`."""
        if config in self.running:
            self.running[config] = self.running.pop(config)  # used last
        else:
            server = config.server(self.log_dir)
            self._make_room(server)
            server.start()
            self.starts += 1
            group = config.prefill_group()  # (reads the model's file: once a server)
            self.running[config] = server, self.shares.setdefault(group, PrefillShare(group)) if group else None
            self.most_running = max(self.most_running, len(self.running))
        self.held.add(config)
        server, share = self.running[config]
        return server.contender(CONTEXT_PER_SLOT, reuse, share)

    def let_go(self) -> None:
        """The work in progress is done with the servers it holds: each may be stopped to make room for another."""
        self.held.clear()

    def _make_room(self, server) -> None:
        """Stop servers not held, the one used last first, until `server` fits beside the rest (the first of a kind
        always starts: nothing measured it yet); `NoRoom` where it cannot."""
        while not self._fits(server):
            idle = [config for config in self.running if config not in self.held]
            if not idle:
                sizes = self._sizes(server)
                raise NoRoom(f"no room for another {server.NAME} server: {available_gib():.1f} GiB of memory left, "
                             f"one holds {max(sizes):.1f} GiB here and {len(sizes)} run; fewer drafters, K values or "
                             "concurrency levels of it fit")
            self._stop(idle[-1])
            self.stopped_for_room += 1

    def _sizes(self, server) -> list[float]:
        return [running.memory_gib() for running, _ in self.running.values() if running.NAME == server.NAME]

    def _fits(self, server) -> bool:
        sizes = self._sizes(server)
        return not sizes or available_gib() >= max(sizes) + MEMORY_MARGIN_GIB

    def _stop(self, config) -> None:
        """Stop one configuration's server; a prefill its share would copy from it is computed again."""
        server, share = self.running.pop(config)
        if share is not None:
            share.forget(server)
        server.stop()

    def stop_all(self) -> None:
        """Stop every server this pool started."""
        for server, _ in self.running.values():
            server.stop()
        self.running.clear()
        self.held.clear()


def in_groups(items: Sequence[T], make: Callable[[T], Contender], pool: ServerPool | None,
              failed: Callable[[T, DraftlabError], object], starting: Callable[[T], object] = lambda item: None
              ) -> Iterator[dict[T, Contender]]:
    """The items' contenders (`make`), in groups whose servers fit in the host's memory together: where the pool has
    no room for the next one's server, the group built so far is yielded to be measured, its servers let go (stopped
    where the next ones need the room), and the item tried again. `starting` hears of each item before its contender
    is built; `failed`, of each that cannot run here."""
    group: dict[T, Contender] = {}
    for item in items:
        starting(item)
        try:
            group[item] = make(item)
        except NoRoom as exc:
            if not group:
                failed(item, exc)
                continue
            yield group
            group = {}
            pool.let_go()
            try:
                group[item] = make(item)
            except DraftlabError as again:
                failed(item, again)
        except DraftlabError as exc:
            failed(item, exc)
    if group:
        yield group
    if pool is not None:
        pool.let_go()


def _server(source: ContenderSource, cell, companions: tuple) -> Contender:
    config = spec_config(gguf_path(source.target.source), cell.drafter, cell.k, cell.concurrency)
    return served_contender(source, cell, companions, config)


def missing() -> str:
    """Why llama-server cannot run here ('' when it can): no server binary."""
    try:
        server_binary()
    except DraftlabError as exc:
        return str(exc)
    return ""


SERVER_AR = Method("server-ar", "llama-server", 2, "llama-server", plain=True, reference="ar", peer=True,
                   gguf_only=True, served=True, swept=False, chosen=False, build=_server, missing=missing)
# llama-server's own speculation: on llama.cpp's stock kernels a block's rows round apart from single rows, so its
# outputs equal plain decoding only up to rounding, even when every one measured did; on a build that holds
# draftlab's exact kernels (`exact_server`, what scripts/build-llama-cpp.sh builds) they are bitwise equal, and it
# is ranked with the lossless.
SERVER = Method("server", "llama-server's own speculation", 4, "llama-server", plain=False, reference="server-ar",
                lossless=False, lossless_here=exact_server, peer=True, gguf_only=True, served=True, swept=False,
                chosen=False, build=_server, missing=missing)
METHODS = (SERVER_AR, SERVER)  # cells from `SweepConfig.servers`, at each concurrency level
