"""Running one (cell, prompt) of a sweep: our decoders, HF's and llama-cpp-python's, built once per target."""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from draftlab.api import LLAMACPP_PLAIN, SpeculativeDecoder, build_drafter, eos_ids, parse_drafter_spec
from draftlab.backends.routes import parse_route
from draftlab.datasets import Prompt
from draftlab.drafters.adapt import AdaptingDrafter
from draftlab.drafters.base import without_memory
from draftlab.drafters.suffix import RESPONSES_FILE, SuffixCache, SuffixDrafter, read_responses
from draftlab.errors import DraftlabError
from draftlab.hf_reference import hf_assist, hf_generate
from draftlab.llamacpp_reference import LlamaCppPeer
from draftlab.models import LoadedModel, gguf_path
from draftlab.policy import FixedK
from draftlab.safeio import load_tensors, save_tensors, write_atomic
from draftlab.sampling import SamplingConfig
from draftlab.study.cells import LLAMACPP_ONLY, PEER_METHODS, Cell, Record

if TYPE_CHECKING:
    from draftlab.study.config import SweepConfig

PROMPTS_FILE = "prompts.json"  # beside a sweep cell's suffix cache: the prompt of each response, in order
ADAPT_FILES = ("adapt-0.pt", "adapt-1.pt")  # an adapting cell's two newest states (what it learned, from which prompts)


class CellRunner:
    """Builds each drafter once per target and runs one (cell, prompt) at a time."""

    def __init__(self, target: LoadedModel, config: "SweepConfig", backend: str | None = None,
                 cache_root: Path | None = None, done: set[tuple[str, str]] = frozenset()) -> None:
        """`backend`: the target's (llamacpp for a 'llamacpp:' target); the config's by default. `cache_root`: where
        each suffix-decoding cell keeps its cache across the cell's prompts, so that a resumed sweep (`done`: the
        stored (cell key, prompt id) pairs) continues with what the cell had learned from exactly those."""
        self.target = target
        self.cache_root = cache_root
        self.done = done
        self.cell_caches: dict[str, SuffixCache] = {}
        self.cell_prompts: dict[str, list[str]] = {}  # prompt ids whose responses each cell's cache holds, in order
        self.cell_learners: dict[str, AdaptingDrafter] = {}  # each adapting cell's own draft, learning its prompts
        self.cell_drafts: dict[str, str] = {}  # digest of the weights each adapting cell started from (its states' key)
        self.config = config
        self.backend = backend or config.backend
        self.eos = eos_ids(target)
        self.baseline = SpeculativeDecoder.from_names(target, drafter="none", k=1, backend=self.backend)
        self.by_drafter: dict[str, SpeculativeDecoder] = {}
        self.by_route: dict[str, SpeculativeDecoder] = {}  # plain decoding in the host's other modes
        self._peer: LlamaCppPeer | None = None

    def decoder(self, drafter: str, k: int) -> SpeculativeDecoder:
        """Our decoder for (drafter, K); drafter 'none' is the baseline. One drafter and target backend are shared."""
        if drafter == "none":
            return self.baseline
        if drafter not in self.by_drafter:
            built = build_drafter(drafter, self.target, self.backend)
            self.by_drafter[drafter] = SpeculativeDecoder(
                self.target, built.drafter, FixedK(1), built.model, self.backend, self.baseline.target_backend
            )
        return self.by_drafter[drafter].with_policy(FixedK(k))

    def cell_decoder(self, cell: Cell, warm_up: bool = False) -> SpeculativeDecoder:
        """The cell's decoder. Suffix decoding learns across requests: each cell has its own cache over its prompts
        in order (never another K's answers to the same prompt), and warm-up runs teach none."""
        decoder = self.decoder(cell.drafter, cell.k)
        drafter = decoder.drafter
        if isinstance(drafter, AdaptingDrafter):
            if cell.key not in self.cell_learners:
                self.cell_learners[cell.key] = self._reload_learner(cell, drafter)
            learner = self.cell_learners[cell.key]
            return decoder.with_drafter(without_memory(learner) if warm_up else learner)
        if not isinstance(drafter, SuffixDrafter):
            return decoder
        if warm_up:
            return decoder.with_drafter(without_memory(drafter))
        if cell.key not in self.cell_caches:
            self.cell_caches[cell.key] = self._reload_cache(cell, drafter)
        return decoder.with_drafter(drafter.with_cache(self.cell_caches[cell.key]))

    def keep_cache(self, cell: Cell, prompt_id: str) -> None:
        """Write the cell's suffix cache after a prompt (before its record is stored: a record never exists without
        the response its cell learned; a response whose record a kill lost is dropped on reload), or its adapted
        draft's state."""
        if cell.key in self.cell_learners and self.cache_root is not None:
            self._keep_learner(cell, prompt_id)
        if cell.key in self.cell_caches and self.cache_root is not None:
            cache = self.cell_caches[cell.key]
            held = [*self.cell_prompts[cell.key], prompt_id]
            self.cell_prompts[cell.key] = held[len(held) - cache.held:]  # a bounded cache drops its oldest
            where = cache.save(self._cache_dir(cell))
            digest = hashlib.sha256((where / RESPONSES_FILE).read_bytes()).hexdigest()
            write_atomic(where / PROMPTS_FILE, json.dumps({"prompts": self.cell_prompts[cell.key],
                                                           "responses_sha256": digest}))

    def _reload_cache(self, cell: Cell, drafter: SuffixDrafter) -> SuffixCache:
        """The cell's cache as a resumed sweep left it: the responses to its stored prompts, in order."""
        cache, prompts = drafter.fresh_cache(), []
        where = self._cache_dir(cell) if self.cache_root is not None else None
        if where is not None:
            for prompt_id, response in _stored_pairs(where):
                if (cell.key, prompt_id) not in self.done:
                    break
                cache.remember(response)
                prompts.append(prompt_id)
        self.cell_prompts[cell.key] = prompts
        return cache

    def _keep_learner(self, cell: Cell, prompt_id: str) -> None:
        """Save the adapting cell's state after its n-th prompt in file n % 2, over the older state: a kill before
        the prompt's record is stored leaves the other, which learned from stored prompts only."""
        learner, where = self.cell_learners[cell.key], self._cache_dir(cell)
        where.mkdir(parents=True, exist_ok=True)
        prompts = [*self.cell_prompts.get(cell.key, []), prompt_id]
        self.cell_prompts[cell.key] = prompts
        name = ADAPT_FILES[len(prompts) % 2]
        save_tensors({"prompts": prompts, "draft": self.cell_drafts[cell.key], **learner.state()}, where / name)

    def _reload_learner(self, cell: Cell, drafter: AdaptingDrafter) -> AdaptingDrafter:
        """The cell's own adapting draft as a resumed sweep left it: the newest state that learned from stored
        prompts only (from the base weights when there is none)."""
        learner, self.cell_prompts[cell.key] = drafter.fork(), []
        self.cell_drafts[cell.key] = weights_digest(learner.state()["learner"]["weights"])
        where = self._cache_dir(cell) if self.cache_root is not None else None
        states = [_read_state(where / name) for name in ADAPT_FILES if where is not None]
        usable = [s for s in states if s is not None and s.get("draft") == self.cell_drafts[cell.key]
                  and all((cell.key, p) in self.done for p in s["prompts"])]
        if usable:
            state = max(usable, key=lambda s: len(s["prompts"]))
            learner.load_state(state)
            self.cell_prompts[cell.key] = state["prompts"]
        return learner

    def _cache_dir(self, cell: Cell) -> Path:
        return self.cache_root / hashlib.sha256(cell.key.encode()).hexdigest()[:16]

    def plain_in(self, label: str) -> SpeculativeDecoder:
        """Plain decoding of the target in another mode (a route label, or llama.cpp's default kernels), built once."""
        if label not in self.by_route:
            self.by_route[label] = (self.baseline.llamacpp_plain() if label == LLAMACPP_PLAIN
                                    else self.baseline.plain_in(parse_route(label)))
        return self.by_route[label]

    def peer(self) -> LlamaCppPeer:
        """llama-cpp-python's own API on the target's GGUF (loaded on first use)."""
        if self._peer is None:
            self._peer = LlamaCppPeer(gguf_path(self.target.source))
        return self._peer

    def runs_here(self, drafter: str) -> bool:
        """Whether the drafter runs on this target's engine (drafts built from torch weights do not on llama.cpp)."""
        try:
            self.decoder(drafter, 1)
        except DraftlabError:
            return False
        return True

    def run(self, cell: Cell, prompt: Prompt, prompt_ids: list[int], warm_up: bool = False) -> Record:
        """Measure one prompt in one cell (`warm_up`: an untimed run that must leave no trace). A prompt that does not
        fit the target's context with the cell's new tokens is refused for every method alike (HF's `generate` would
        run past the context with a warning)."""
        if len(prompt_ids) + cell.max_new_tokens > self.target.context_length:
            raise DraftlabError(f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({cell.max_new_tokens}) exceeds "
                                f"the model's context of {self.target.context_length} tokens")
        sampling = SamplingConfig(cell.temperature)
        if cell.method == "hf":  # AsG's own plain decoding: HF generate without an assistant
            tokens, wall = hf_generate(self.target, prompt_ids, cell.max_new_tokens, self.eos, sampling,
                                       self.config.seed)
            return Record(cell, prompt.id, prompt.category, len(tokens), 0, 0, 0, wall_s=wall,
                          output_sha=token_sha(tokens))
        if cell.method in LLAMACPP_ONLY:  # llama-cpp-python's plain generate, or its prompt lookup at K
            tokens, wall = self.peer().generate(prompt_ids, cell.max_new_tokens, self.eos, sampling, self.config.seed,
                                                cell.k if cell.method == "lcp" else 0)
            return Record(cell, prompt.id, prompt.category, len(tokens), 0, 0, 0, wall_s=wall,
                          output_sha=token_sha(tokens))
        if cell.method == "asg":
            decoder = self.decoder(cell.drafter, cell.k)
            assist = hf_assist(parse_drafter_spec(cell.drafter), decoder.draft_model, cell.k)
            tokens, wall = hf_generate(self.target, prompt_ids, cell.max_new_tokens, self.eos, sampling,
                                       self.config.seed, assist)
            return Record(cell, prompt.id, prompt.category, len(tokens), 0, 0, 0, wall_s=wall,
                          output_sha=token_sha(tokens))
        decoder = self.plain_in(cell.drafter) if cell.method == "plain" else self.cell_decoder(cell, warm_up)
        result = decoder.generate(
            prompt_ids, max_new_tokens=cell.max_new_tokens, temperature=cell.temperature, seed=self.config.seed
        )
        s = result.stats
        return Record(
            cell, prompt.id, prompt.category, s.new_tokens, s.steps, s.drafted, s.accepted,
            s.accepted_per_step_list, s.drafted_per_step_list, s.prefill_s, s.draft_s, s.target_s, s.overhead_s,
            s.wall_s, token_sha(result.token_ids), levels_per_step=s.levels_per_step_list if s.has_trees else [],
            cache_held=s.cache_held,
        )

    def asg_supported(self, drafter: str) -> bool:
        """Whether HF assisted generation can run this drafter (n-gram, or a full-vocabulary model draft)."""
        try:
            hf_assist(parse_drafter_spec(drafter), self.decoder(drafter, 1).draft_model, 1)
        except DraftlabError:
            return False
        return True

    def warm_up(self, cells: list[Cell], prompt: Prompt, prompt_ids: list[int]) -> None:
        """Untimed short runs through every path: first calls pay one-off costs. A cell that fails here is left to
        its timed runs, which store the reason."""
        for cell in cells:
            try:
                self.run(replace(cell, max_new_tokens=8), prompt, prompt_ids, warm_up=True)
            except (Exception if cell.method in PEER_METHODS else DraftlabError):
                continue


def _stored_pairs(where: Path) -> list[tuple[str, list[int]]]:
    """(prompt id, response) of a suffix cell's saved cache, in order; none when the prompt list is torn, foreign,
    or was not written after the responses it pairs with (a kill between the two writes): the cell then starts
    cold, which costs speed, never a prompt timed with its own answer."""
    try:
        stored = json.loads((where / PROMPTS_FILE).read_text(encoding="utf-8"))
        digest = hashlib.sha256((where / RESPONSES_FILE).read_bytes()).hexdigest()
    except (OSError, ValueError):
        return []
    if not isinstance(stored, dict) or stored.get("responses_sha256") != digest:
        return []
    prompts = stored.get("prompts")
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        return []
    return list(zip(prompts, read_responses(where / RESPONSES_FILE)))


def _read_state(path: Path) -> dict | None:
    """An adapting cell's saved state, or None when it is missing or unreadable (a kill mid-write leaves only
    the .tmp file; the cell then goes on from its other state, or from the base weights)."""
    try:
        return load_tensors(path, "an adapting cell's state") if path.exists() else None
    except DraftlabError:  # a damaged or foreign file counts as missing: the cell learns less, never runs its code
        return None


def weights_digest(weights: dict[str, torch.Tensor]) -> str:
    """SHA256 over a state dict's names and bytes: a saved state only resumes a cell whose draft it started from."""
    digest = hashlib.sha256()
    for name in sorted(weights):
        digest.update(name.encode())
        digest.update(weights[name].detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def token_sha(tokens: list[int]) -> str:
    """SHA256 of a token id list."""
    return hashlib.sha256(json.dumps(tokens).encode()).hexdigest()
