"""The speculative decoding loop: draft, score, verify, commit, roll back, for a batch of runs at once.

The engine composes five parts and nothing else: a `Drafter` per run (proposes), the target as `Sequences` (scores
every run's block in one call), the verifier (accepts or rejects), each run's `DraftLengthPolicy` and the step's
`StepK` (choose K). Its unit is the step of a batch of runs (`step`): `draftlab generate` and a study's cell step a
batch of one (`generate`), `draftlab serve` steps every request in flight (`draftlab.serving.scheduler` only admits,
prefills and retires runs). With `NoDrafter` the same loop is plain autoregressive decoding, which is the baseline
every speedup is measured against.

Cache invariant: between steps each run's target cache holds every committed token but the last. A step scores a
block (`draftlab.decoding.step.Block`) per run: the last committed token (the root) and the drafted tokens, a chain
or a tree, each row scoring the token after it. After verification the run's view of the target keeps the root and
the accepted path (`Backend.keep`), so that the cache again holds every committed token but the newest. Drafters
that read the target's hidden states get the rows of exactly those cached tokens through `observe`, so they too know
every committed token but the newest.
"""

from __future__ import annotations

import operator
import time
from typing import Callable, Sequence

import torch

from draftlab.backends.base import Backend, Stopwatch
from draftlab.backends.sequences import OneSequence, Sequences
from draftlab.decoding.kchoice import PerRunK, StepK, StepRun
from draftlab.decoding.metrics import GenerationStats
from draftlab.decoding.policy import DraftLengthPolicy, FixedK, with_confidence_stop
from draftlab.generation import (GenerationConfig, GenerationResult, Generation, Lane, Plan, PromptCache,
                                   StopCriteria, Stepped, check_room, tokens_result)
from draftlab.decoding.step import Block, Proposal, Scores
from draftlab.decoding.verify import Verifier, verify
from draftlab.drafters.base import DraftAsk, Drafter, NoDrafter
from draftlab.errors import DraftlabError

__all__ = ["GenerationConfig", "GenerationResult", "PromptCache", "SpeculativeEngine", "check_room", "tokens_result"]


class SpeculativeEngine:
    """Lossless speculative decoding over a target: one run, or a batch of runs stepped together."""

    def __init__(
        self,
        target: Backend,
        drafter: Drafter | None = None,
        policy: DraftLengthPolicy | None = None,
        context_length: int = 1 << 30,
        decode: Callable[[list[int]], str] | None = None,
        verifier: Verifier = verify,
        prompt_cache: PromptCache | None = None,
        sequences: Sequences | None = None,
        chooser: StepK | None = None,
    ) -> None:
        """target: the backend of a run alone (sequence 0 of `sequences`); sequences: the target as a batch of
        sequences (default: `target` alone); chooser: every run's K at each step (default: each run's own policy).
        verifier: the acceptance rule; only `draftlab audit`'s own tests replace it (with a broken one).
        prompt_cache: shared by the engines over this backend that reuse a prompt's prefill (None: every generation
        prefills)."""
        self.target = target
        self.sequences = sequences or OneSequence(target)
        self.chooser = chooser or PerRunK()
        self.prompt_cache = prompt_cache
        self.verifier = verifier
        self.drafter = drafter or NoDrafter()
        # A drafter's adaptive confidence stop is moved by a policy around the K policy, not by the drafter.
        self.policy = with_confidence_stop(policy or FixedK(1), self.drafter.confidence_stop())
        self.lane = Lane(target, self.drafter, self.policy)
        self.context_length = context_length
        self.decode = decode
        self.reads_hidden = self.drafter.reads_target_hidden
        self.taps = self.drafter.target_taps  # the target layers whose inputs it reads; (): the final hidden states
        self.steps = 0  # calls of `step`
        if self.reads_hidden and not target.provides_hidden:
            raise DraftlabError(
                f"drafter {self.drafter.name} reads the target's hidden states, which this backend does not "
                "provide; use another backend"
            )

    def lane_for(self, seq: int) -> Lane:
        """A lane for one more sequence decoded beside the others (`draftlab serve`'s slots): the sequence's view and
        a drafter beside this one's, sharing what it learns across requests; its K comes from the step's chooser."""
        return Lane(self.sequences.view(seq), self.drafter.beside(seq), FixedK(1), seq)

    def generate(
        self,
        prompt_ids: Sequence[int],
        config: GenerationConfig,
        on_tokens: Callable[[list[int]], None] | None = None,
    ) -> GenerationResult:
        """Generate from `prompt_ids`, a batch of one run; `on_tokens` sees each step's committed tokens."""
        run = self.start(prompt_ids, config, on_tokens)
        while not run.done:
            self.step([run])
        return self.finish(run)

    def start(self, prompt_ids: Sequence[int], config: GenerationConfig,
              on_tokens: Callable[[list[int]], None] | None = None, lane: Lane | None = None,
              prefill: bool = True, cached: int = 0) -> Generation:
        """A run from `prompt_ids` on a lane (default: the engine's own), its prompt prefilled whole (or, with
        `prefill=False`, left to `prefill_part`, after the first `cached` tokens its sequence holds already): what
        `step` advances."""
        lane = lane or self.lane
        tokens = self._check_prompt(prompt_ids, config)
        stats = GenerationStats(prompt_tokens=len(tokens), cache_held=lane.drafter.held())
        run = Generation(lane, tokens, config, stats, Stopwatch(lane.target.synchronize),
                         torch.Generator().manual_seed(config.seed), StopCriteria(config, self.decode), on_tokens,
                         prompt_length=len(tokens))
        if prefill:
            self._prefill(tokens, run.watch, lane)
            run.prefilled = len(tokens) - 1
        else:
            if cached and self.reads_hidden:
                raise DraftlabError(f"drafter {self.drafter.name} reads the target's states of every prompt token: "
                                    "a run prefills its whole prompt")
            if not 0 <= cached < len(tokens) or lane.target.cache_len != cached:
                raise DraftlabError(f"a run may reuse up to all but the last of its {len(tokens)} prompt tokens, "
                                    f"held in its sequence; {cached} asked for, {lane.target.cache_len} held")
            self._begin(lane, tokens)
            run.prefilled = cached
        return run

    def prefill_part(self, run: Generation) -> None:
        """The next chunk of a run's prompt into its sequence: the sequences' chunk at a fixed offset (a multiple of
        it, whatever else is in flight), so that its cache is the one a whole prefill leaves."""
        chunk = self.sequences.prefill_chunk or run.prompt_length
        end = min(run.prefilled + chunk, run.prompt_length - 1)
        with run.watch.time("prefill"):
            hidden = self.sequences.prefill(run.lane.seq, run.tokens[run.prefilled:end], end == run.prompt_length - 1,
                                            self.reads_hidden, self.taps)  # [n, D'] or None
            if hidden is not None:  # a drafter that reads the target's states takes the chunk's in
                run.lane.drafter.observe(hidden)
        run.prefilled = end

    def step(self, runs: Sequence[Generation]) -> Stepped:
        """One step of every run: each drafts to its cap, the chooser keeps each draft's first K levels, one call
        scores every block, each verifies and commits (a run whose stop fires is done)."""
        self.steps += 1
        steps = [StepRun(run.lane.seq, run.lane.policy.next_k(), self._room(run), run.record,
                         run.lane.drafter.lag(run.tokens)) for run in runs]
        plans = self.draft(runs, self.chooser.caps(steps))
        kept_depths = self.chooser.choose(steps, [len(plan.proposal.levels) for plan in plans])
        plans = [plan.within(depth) for plan, depth in zip(plans, kept_depths)]
        blocks = {run.lane.seq: plan.block for run, plan in zip(runs, plans)}
        runs[0].lane.target.synchronize()  # the drafts' device work is the draft's time, not the target's
        started = time.perf_counter()
        scores = self.sequences.score_blocks(blocks, self.reads_hidden, taps=self.taps)  # logits [n, V] per run
        runs[0].lane.target.synchronize()
        for run in runs:  # each run waited the whole pass
            run.watch.seconds["target"] = run.watch.seconds.get("target", 0.0) + time.perf_counter() - started
        kept = [self.settle(run, plan, scores[run.lane.seq]) for run, plan in zip(runs, plans)]
        return Stepped([len(p.proposal.tokens) for p in plans], [len(k) for k in kept],
                       sum(len(b.tokens) for b in blocks.values()))

    def draft(self, runs: Sequence[Generation], caps: Sequence[int]) -> list[Plan]:
        """Every run's draft at its depth (at most what it has room for), in one call of the drafter (a served draft
        model decodes each position of every run at once): the blocks the target scores next. Each run waited the
        whole drafting."""
        budgets = [min(cap, self._room(run)) for run, cap in zip(runs, caps)]
        asks = [DraftAsk(run.lane.drafter, run.lane.seq, run.tokens, budget, run.config.sampling, run.generator)
                for run, budget in zip(runs, budgets)]
        watch = runs[0].watch
        before = watch.seconds.get("draft", 0.0)
        with watch.time("draft"):
            proposals = self.drafter.propose_all(asks)
        seconds = watch.seconds["draft"] - before
        self.chooser.timed(seconds, [len(proposal.levels) for proposal in proposals])
        plans = []
        for i, (run, proposal, budget) in enumerate(zip(runs, proposals, budgets)):
            if i:
                run.watch.seconds["draft"] = run.watch.seconds.get("draft", 0.0) + seconds
            if run.stats.steps == 0:  # the step in which a draft model prefills the prompt
                run.stats.first_draft_s = seconds
            proposal = proposal.within(budget)  # K is the depth: a chain's length, a tree's levels
            plans.append(Plan(Block.of(run.tokens[-1], proposal), proposal, budget))
        return plans

    def settle(self, run: Generation, plan: Plan, scores: Scores) -> list[int]:
        """Verify the scored block, keep its accepted rows, commit its tokens up to a stop; the tokens kept."""
        committed, levels, num_accepted = self._verify(run, plan, scores)
        asked, accepted = self._outcome(run, plan, committed, len(levels), num_accepted)
        run.record.observe(asked, accepted)
        self.chooser.observe(asked, accepted)
        kept, run.stats.stop_reason = self._commit(committed, run.new, run.stop)
        # A stop inside the block drops what follows it: count only accepted tokens that were kept.
        run.stats.record_step(levels, min(num_accepted, len(kept)))
        run.tokens.extend(kept)
        if run.on_tokens is not None:
            run.on_tokens(kept)
        return kept

    @staticmethod
    def _outcome(run: Generation, plan: Plan, committed: list[int], depth: int, accepted: int) -> tuple[int, int]:
        """The levels the records learn from: those scored and accepted, and, greedy, where the chooser cut a chain
        short and every level kept was accepted, one level further for free: the drafted token after them against
        the target's own next token (its acceptance exactly). A run whose drafts were dropped (K 0) thus still
        learns whether they would have held, and is not held at K 0 by a few early misses."""
        if plan.beyond is None or accepted < depth or not run.config.sampling.greedy:
            return depth, accepted
        return depth + 1, accepted + (committed[depth] == plan.beyond)

    def finish(self, run: Generation) -> GenerationResult:
        """The generation's result; the drafter hears the whole sequence (what it learns across requests)."""
        run.lane.drafter.finish(run.tokens)
        stats = run.stats
        stats.wall_s = time.perf_counter() - run.started
        stats.new_tokens = len(run.new)
        stats.prefill_s = run.watch.seconds.get("prefill", 0.0)
        stats.draft_s = run.watch.seconds.get("draft", 0.0)
        stats.target_s = run.watch.seconds.get("target", 0.0)
        text = self.decode(run.new) if self.decode is not None else ""
        return GenerationResult(run.new, text, stats)

    def next_token_logits(self, prompt_ids: Sequence[int]) -> torch.Tensor:
        """The target's logits [V] for the token after the prompt, computed exactly as a generation's first step
        computes them (same prefill, same block): the reference an audit of sampling compares with."""
        tokens = list(prompt_ids)
        self._prefill(tokens, Stopwatch(self.target.synchronize), self.lane)
        logits = self.target.score_block(Block.chain(tokens[-1:])).logits  # [1, V]
        self.target.reset()
        if self.prompt_cache is not None:
            self.prompt_cache.forget()
        return logits[0]

    def prefill(self, prompt_ids: Sequence[int]) -> None:
        """Prefill the prompt into the shared prompt cache, so that the next generation from it (by any engine that
        shares the cache) starts from it; the measurement loop times this once per prompt."""
        self._prefill(list(prompt_ids), Stopwatch(self.target.synchronize), self.lane)

    def _verify(self, run: Generation, plan: Plan, scores: Scores) -> tuple[list[int], list[int], int]:
        """Verify a scored block and keep its accepted rows: the tokens it commits (accepted + recovered/bonus),
        drafted tokens per level, accepted count."""
        block, proposal, lane, config = plan.block, plan.proposal, run.lane, run.config
        verdict = self.verifier(block, proposal.draft_probs, scores.logits, config.sampling, run.generator)
        kept = verdict.kept_rows()
        if config.sampling.greedy and not block.is_chain and not set(kept) <= lane.target.exact_rows(block):
            with run.watch.time("target"):
                block, proposal, scores, verdict = self._reverify(lane.target, block, kept, run)
            kept = verdict.kept_rows()
        lane.target.keep(kept)
        if scores.hidden is not None:  # rows of the tokens now committed and cached
            lane.drafter.observe(scores.hidden[kept])
        lane.drafter.hear(proposal, verdict)
        levels = proposal.levels
        lane.policy.observe(len(levels), verdict.num_accepted)  # K is the depth: a full path is all accepted
        return verdict.committed(proposal), levels, verdict.num_accepted

    def _reverify(self, target: Backend, block: Block, kept: list[int], run: Generation):
        """Greedy, a tree path over rows the backend could not score exactly: score that path again as a chain
        (exact rows) and verify it there, so that what is committed is what plain decoding commits."""
        target.rollback(target.cache_len - len(block.tokens))
        path = Block.chain([block.tokens[i] for i in kept])
        proposal = Proposal(path.tokens[1:])
        scores = target.score_block(path, self.reads_hidden, taps=self.taps)  # logits [m, V]
        return path, proposal, scores, self.verifier(path, None, scores.logits, run.config.sampling, run.generator)

    def _room(self, run: Generation) -> int:
        """Deepest draft worth proposing: a step commits at most depth + 1 tokens; no deeper than the run's own cap
        (`GenerationConfig.max_draft`, a request's `speculative.n_max`)."""
        room = min(run.config.max_new_tokens - len(run.new), self.context_length - len(run.tokens))
        cap = run.config.max_draft
        return max(0, room - 1) if cap is None else max(0, min(room - 1, cap))

    @staticmethod
    def _begin(lane: Lane, tokens: list[int]) -> None:
        """A new generation on the lane: its drafter and policy start."""
        lane.drafter.begin(tokens)
        lane.policy.begin()

    def _prefill(self, tokens: list[int], watch: Stopwatch, lane: Lane) -> None:
        """Fill the lane's target cache with every prompt token but the last (or roll it back to them, when the
        prompt cache holds them); start drafter and policy."""
        self._begin(lane, tokens)
        target, cache = lane.target, self.prompt_cache if lane is self.lane else None
        if cache is not None and cache.holds(tokens[:-1], target, self.reads_hidden, self.taps):
            target.rollback(len(cache.tokens))
            if self.reads_hidden and cache.tokens:
                with watch.time("prefill"):  # the drafter takes the prompt's states in
                    lane.drafter.observe(cache.hidden)
            return
        target.reset()
        hidden = None
        if len(tokens) > 1:
            with watch.time("prefill"):
                scores = target.score_block(Block.chain(tokens[:-1]), self.reads_hidden, last_only=True,
                                            taps=self.taps)
                hidden = scores.hidden  # [n - 1, D'] or None
                if hidden is not None:
                    lane.drafter.observe(hidden)
        if cache is not None:
            cache.tokens, cache.hidden, cache.taps = tuple(tokens[:-1]), hidden, self.taps
            cache.prefills += 1

    @staticmethod
    def _commit(committed: list[int], new: list[int], stop: StopCriteria) -> tuple[list[int], str]:
        """Append committed tokens one by one until a stop condition fires."""
        kept: list[int] = []
        for token in committed:
            new.append(token)
            kept.append(token)
            reason = stop.check(new)
            if reason:
                return kept, reason
        return kept, ""

    def _check_prompt(self, prompt_ids: Sequence[int], config: GenerationConfig) -> list[int]:
        try:
            tokens = [operator.index(t) for t in prompt_ids]
        except TypeError:
            raise DraftlabError("prompt token ids must be integers") from None
        if not tokens:
            raise DraftlabError("the prompt is empty; give at least one token of text")
        check_room(len(tokens), config.max_new_tokens, self.context_length)
        outside = [t for t in tokens if not 0 <= t < self.target.vocab_size]
        if outside:
            raise DraftlabError(f"prompt token id {outside[0]} is not in the target's vocabulary "
                                f"(0..{self.target.vocab_size - 1})")
        return tokens
