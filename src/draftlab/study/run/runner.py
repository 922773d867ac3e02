"""A sweep's contenders for each (cell, prompt), as each cell's method builds them (`contenders.contract`): what is
built once per target (the target, draftlab's decoders, a peer's instance) is built here.

The measurement loop (`draftlab.measure`) times them; a cell whose drafter learns across requests (suffix decoding,
online adaptation) keeps its own copy, whose state (`Drafter.state`) is saved beside the database after each
prompt, so that a resumed sweep goes on with what the cell had learned from its stored prompts."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, TypeVar

import torch

from draftlab.api import SpeculativeDecoder, build_drafter, eos_ids
from draftlab.drafters.base import Drafter
from draftlab.errors import DraftlabError
from draftlab.contenders.hf import assist_of
from draftlab.measure import Contender, EncodedPrompt, RunRecord, RunSettings, warm_up
from draftlab.models import LoadedModel
from draftlab.contenders.plain import plain_mode
from draftlab.decoding.policy import FixedK
from draftlab.files.safeio import load_tensors, save_tensors
from draftlab.study.run.cells import Cell, Record
from draftlab.contenders.methods import method_of
from draftlab.contenders.server_configs import ServerPool, in_groups
from draftlab.drafters.kinds import is_plain_drafter

if TYPE_CHECKING:
    from draftlab.study.run.config import SweepConfig

T = TypeVar("T")
STATE_FILES = ("state-0.pt", "state-1.pt")  # a learning cell's two newest states (what it learned, from which prompts)


class CellRunner:
    """Builds each drafter once per target and gives each (cell, prompt) its contender for the measurement loop (the
    study's `contenders.contract.ContenderSource`)."""

    def __init__(self, target: LoadedModel, config: "SweepConfig", backend: str | None = None,
                 cache_root: Path | None = None, done: set[tuple[str, str]] = frozenset(),
                 servers: ServerPool | None = None) -> None:
        """`backend`: the target's (llamacpp for a 'llamacpp:' target); the config's by default. `cache_root`: where
        each cell whose drafter learns across requests keeps what it learned across the cell's prompts, so that a
        resumed sweep (`done`: the stored (cell key, prompt id) pairs) continues with what the cell had learned from
        exactly those. `servers`: where llama-server cells get their servers (the sweep stops them)."""
        self.target = target
        self.cache_root = cache_root
        self.done = done
        self.cell_drafters: dict[str, Drafter] = {}  # each learning cell's own drafter, learning its prompts
        self.cell_prompts: dict[str, list[str]] = {}  # prompt ids each learning cell learned from, in order
        self.cell_starts: dict[str, str] = {}  # digest of each learning cell's state as built (its states' key)
        self.config = config
        self.backend = backend or config.backend
        self.eos = eos_ids(target)
        # Every decoder of the target shares its backend and its prefill of each prompt (`engine.PromptCache`).
        self.baseline = SpeculativeDecoder.from_names(target, drafter="none", k=1,
                                                      backend=self.backend).with_prompt_cache("draftlab")
        self.by_drafter: dict[str, SpeculativeDecoder] = {}
        self.parameters: dict[str, int] = {}  # per drafter: its parameters (`BuiltDraft.parameters`), 0: none
        self.by_route: dict[str, SpeculativeDecoder] = {}  # plain decoding in the host's other modes
        self.built: dict[str, Any] = {}  # what methods share per target (`shared`): a peer's loaded instance
        self.servers = servers

    def decoder(self, drafter: str, k: int) -> SpeculativeDecoder:
        """Our decoder for (drafter, K); drafter 'none' is the baseline. One drafter and target backend are shared."""
        if is_plain_drafter(drafter):
            return self.baseline
        if drafter not in self.by_drafter:
            built = build_drafter(drafter, self.target, self.backend)
            self.parameters[drafter] = built.parameters
            self.by_drafter[drafter] = SpeculativeDecoder(
                self.target, built.drafter, FixedK(1), self.baseline.target_backend, built.model, self.backend,
                self.baseline.prompt_cache,
            )
        return self.by_drafter[drafter].with_policy(FixedK(k))

    def draft_parameters(self, drafter: str) -> int:
        """The parameters of a drafter's draft, the target parts it reads included; 0: one without weights."""
        self.decoder(drafter, 1)
        return self.parameters.get(drafter, 0)

    def cell_decoder(self, cell: Cell) -> SpeculativeDecoder:
        """The cell's decoder. A drafter that learns across requests gets the cell's own copy, which learns the
        cell's prompts in order (never another K's answers to the same prompt)."""
        decoder = self.decoder(cell.drafter, cell.k)
        if decoder.drafter.held() is None:
            return decoder
        if cell.key not in self.cell_drafters:
            self.cell_drafters[cell.key] = self._reload(cell, decoder.drafter)
        return decoder.with_drafter(self.cell_drafters[cell.key])

    def contender(self, cell: Cell, companions: tuple[EncodedPrompt, ...] = ()) -> Contender:
        """What the measurement loop runs for the cell, as its method builds it (`contenders.methods`); under load, with
        `companions`, the prompts sent beside each one (llama-server, as many as it needs)."""
        return method_of(cell.method).contender(self, cell, companions)

    def in_groups(self, cells: list[Cell], failed: Callable[[Cell, DraftlabError], object],
                  starting: Callable[[Cell], object] = lambda cell: None,
                  companions: tuple[EncodedPrompt, ...] = ()) -> Iterator[dict[Cell, Contender]]:
        """The cells' contenders in groups whose servers fit in the host's memory together, each yielded to be
        measured before the next is built (`contenders.server_configs.in_groups`)."""
        return in_groups(cells, lambda cell: self.contender(cell, companions), self.servers, failed, starting)

    def shared(self, name: str, build: Callable[[], T]) -> T:
        """The object methods share under `name` for this target (a peer's instance), built on first use."""
        if name not in self.built:
            self.built[name] = build()
        return self.built[name]

    def settings(self, cell: Cell) -> RunSettings:
        """The cell's generation settings for the measurement loop."""
        return RunSettings(cell.max_new_tokens, cell.temperature, seed=self.config.seed)

    def keep_state(self, cell: Cell, prompt_id: str) -> None:
        """After a prompt, save what the cell's drafter learned (before its record is stored: a record never exists
        without what its cell learned from it), in state file n % 2 after its n-th prompt, over the older state: a
        kill before the record is stored leaves the other, which learned from stored prompts only."""
        if cell.key not in self.cell_drafters or self.cache_root is None:
            return
        drafter, where = self.cell_drafters[cell.key], self._cache_dir(cell)
        where.mkdir(parents=True, exist_ok=True)
        prompts = [*self.cell_prompts.get(cell.key, []), prompt_id]
        self.cell_prompts[cell.key] = prompts
        save_tensors({"prompts": prompts, "start": self.cell_starts[cell.key], "state": drafter.state()},
                     where / STATE_FILES[len(prompts) % 2])

    def _reload(self, cell: Cell, drafter: Drafter) -> Drafter:
        """The cell's own drafter as a resumed sweep left it: the newest state that learned from stored prompts
        only (as built when there is none)."""
        own, self.cell_prompts[cell.key] = drafter.fork(), []
        self.cell_starts[cell.key] = state_digest(own.state())
        where = self._cache_dir(cell) if self.cache_root is not None else None
        states = [_read_state(where / name) for name in STATE_FILES if where is not None]
        usable = [s for s in states if s is not None and s.get("start") == self.cell_starts[cell.key]
                  and all((cell.key, p) in self.done for p in s["prompts"])]
        if usable:
            state = max(usable, key=lambda s: len(s["prompts"]))
            own.load_state(state["state"])
            self.cell_prompts[cell.key] = state["prompts"]
        return own

    def _cache_dir(self, cell: Cell) -> Path:
        return self.cache_root / hashlib.sha256(cell.key.encode()).hexdigest()[:16]

    def plain_in(self, label: str) -> SpeculativeDecoder:
        """Plain decoding of the target in another mode (a route label, or llama.cpp's default kernels), built once."""
        if label not in self.by_route:
            mode = plain_mode(self.baseline, label)  # the baseline itself where the mode is its own
            self.by_route[label] = mode if mode.prompt_cache else mode.with_prompt_cache(f"draftlab {label}")
        return self.by_route[label]

    def why_not_here(self, drafter: str) -> str:
        """Why the drafter cannot run on this target's engine, in one line (drafts built from torch weights do not
        on llama.cpp; a draft not built yet); '' where it runs."""
        try:
            self.decoder(drafter, 1)
        except DraftlabError as exc:
            return str(exc).splitlines()[0] or type(exc).__name__
        return ""

    def asg_supported(self, drafter: str) -> bool:
        """Whether HF assisted generation can run this drafter (n-gram, or a full-vocabulary model draft)."""
        try:
            assist_of(self, drafter, 1)
        except DraftlabError:
            return False
        return True

    def warm_up(self, cells: list[Cell], prompt: EncodedPrompt, starting: Callable[[Cell], None]) -> None:
        """Untimed short runs through every path: first calls pay one-off costs. A cell that fails here is left to
        its timed runs, which store the reason. `starting` hears of each cell before it runs. Each cell's server is
        let go once it ran: the next one may stop it to make room (every server then starts once here)."""
        for cell in cells:
            starting(cell)
            try:
                warm_up({cell: self.contender(cell)}, prompt, self.settings(cell))
            except (Exception if method_of(cell.method).peer else DraftlabError):
                pass
            if self.servers is not None:
                self.servers.let_go()


def record_of(cell: Cell, run: RunRecord) -> Record:
    """The store's record of one run of a cell."""
    s = run.stats
    return Record(
        cell, run.prompt_id, run.category, s.new_tokens, s.steps, s.drafted, s.accepted,
        s.accepted_per_step_list, s.drafted_per_step_list, s.prefill_s, s.draft_s, s.target_s, s.overhead_s,
        s.wall_s, token_sha(run.token_ids), levels_per_step=s.levels_per_step_list if s.has_trees else [],
        cache_held=s.cache_held, window_tokens=s.window_tokens, latency_s=s.latency_s,
    )


def _read_state(path: Path) -> dict | None:
    """A learning cell's saved state, or None when it is missing or unreadable (a kill mid-write leaves only
    the .tmp file; the cell then goes on from its other state, or from the drafter as built)."""
    try:
        return load_tensors(path, "a sweep cell's learned state") if path.exists() else None
    except DraftlabError:  # a damaged or foreign file counts as missing: the cell learns less, never runs its code
        return None


def state_digest(state) -> str:
    """SHA256 over a drafter's state (names, numbers, lists and tensor bytes): a saved state only resumes a cell
    whose drafter started from the same state."""
    digest = hashlib.sha256()
    _feed(digest, state)
    return digest.hexdigest()


def _feed(digest, value) -> None:
    if isinstance(value, dict):
        for name in sorted(value):
            digest.update(str(name).encode())
            _feed(digest, value[name])
    elif isinstance(value, (list, tuple)):
        digest.update(b"[%d]" % len(value))
        for item in value:
            _feed(digest, item)
    elif isinstance(value, torch.Tensor):
        digest.update(value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    else:
        digest.update(repr(value).encode())


def token_sha(tokens: list[int]) -> str:
    """SHA256 of a token id list."""
    return hashlib.sha256(json.dumps(tokens).encode()).hexdigest()
