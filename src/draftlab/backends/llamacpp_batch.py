"""Several sequences of one llama.cpp model decoded in one pass, each bitwise as it decodes alone: the backend
`draftlab serve` runs its requests in flight on.

One `llama_context` holds one KV stream per slot (`kv_unified = False`, as llama-server's slots do): a slot's cells
start at cell 0 of its own stream and lie in position order, exactly where its cells lie when it decodes alone. In a
unified cache the cells of other sequences would interleave with its own and shift how attention's SIMD lanes split
the sum over cells, even masked out. With the exact kernels (`LlamaCppModel.rows_exact`), each product row keeps its
order of additions at every row count; so a step's one `llama_decode` of every active slot's block gives each row
bitwise the logits that row gets when its sequence decodes alone (tests/integration/test_serve.py proves it with
requests joining and leaving mid-decode).

llama.cpp splits a batch of several streams into ubatches of an equal number of tokens per sequence and consecutive
sequence ids (`llama_batch_allocr::split_equal`): blocks of unequal length or a gap between slots cost extra graph
passes over the weights, never exactness. `SlotView` is one slot as a `Backend`, so that the engine prefills, keeps
and rolls back a slot as it does a backend of its own.

A prompt prefills as `LlamaCppBackend` prefills it (on the model's repacked twin, its cache then copied into the
slot), so a request's cache is the one `draftlab generate` builds. For an EAGLE-3 draft the decode (and each prefill
chunk) hands over every row's inputs of the tapped target layers (`LayerTaps`), split by slot as the logits are.
"""

from __future__ import annotations

import ctypes
from typing import Sequence

import numpy as np
import torch

from draftlab.backends.base import greedy_rows
from draftlab.backends.gguf import LlamaCppModel, llama_lib
from draftlab.backends.gguf import threads as default_threads
from draftlab.backends.llamacpp import MAX_BATCH, MAX_CONTEXT, LlamaCppBackend, free_native
from draftlab.backends.llamacpp_taps import LayerTaps
from draftlab.decoding.kchoice import llama_passes
from draftlab.decoding.step import Block, Scores
from draftlab.errors import DraftlabError


class LlamaCppBatch:
    """A GGUF model in llama.cpp with `slots` sequences, each in a KV stream of its own."""

    def __init__(self, model: LlamaCppModel, slots: int, context: int | None = None, threads: int | None = None
                 ) -> None:
        """`context`: the cells of each slot (default: the model's training context, at most 8192); `threads`:
        llama.cpp's (default: the cores this process may use; each row's sums keep their order at any count)."""
        if slots < 1:
            raise DraftlabError(f"a batch needs at least one slot, got {slots}")
        self.lib = llama_lib()
        self.model = model
        self.slots = slots
        self.vocab_size = model.vocab_size
        self.batch_invariant = model.rows_exact
        self.numerics = LlamaCppBackend.numerics_of(model)
        self.n_ctx = min(context or MAX_CONTEXT, model.n_ctx_train, MAX_CONTEXT)
        self._threads = threads or default_threads()
        self._ctx = self._new_context(self._threads)
        self._memory = self.lib.llama_get_memory(self._ctx)
        self.taps = LayerTaps(self.lib, model, self._ctx)  # target layers whose inputs each decode records (EAGLE-3)
        self._batch = self.lib.llama_batch_init(MAX_BATCH, 0, 1)
        self._lengths = [0] * slots  # cached tokens per slot
        self._starts = [0] * slots  # where each slot's last scored block began
        self._prefiller: LlamaCppBatch | None = None  # the repacked twin's slots, for prefills (a file loaded without repack)
        self._prefilling = [False] * slots  # a prompt part-prefilled in the twin's stream of the slot
        self.decodes = 0  # llama_decode calls on this context (a served draft's: one per draft position a step)

    @property
    def keeps_prefixes(self) -> bool:
        """On the exact kernels without a twin (the model loaded repacked, rows as alone at every row count), a
        token's cells are the same whether a prefill chunk or a step's block computed them: a slot's cells serve a
        later prompt that starts with its tokens (a chat's next turn), as a prefill of them would."""
        return self.model.rows_exact and self.model.repack

    def view(self, slot: int) -> "SlotView":
        """The slot as a `Backend`, for its engine."""
        return SlotView(self, slot)

    def length(self, slot: int) -> int:
        """Tokens cached in a slot."""
        return self._lengths[slot]

    def rollback(self, slot: int, length: int) -> None:
        """Keep only the first `length` tokens of a slot (0: empty, a prompt's prefill on the twin dropped too)."""
        if length == 0 and self._prefilling[slot]:
            self._prefiller.rollback(slot, 0)
            self._prefilling[slot] = False
        if length < self._lengths[slot]:
            self.lib.llama_memory_seq_rm(self._memory, slot, length, -1)
            self._lengths[slot] = length

    def keep(self, slot: int, count: int) -> None:
        """Keep a slot's cache before its last block plus that block's first `count` tokens (a chain's root and
        accepted path)."""
        self.rollback(slot, self._starts[slot] + count)

    prefill_chunk = MAX_BATCH  # prompt tokens a chunk prefills, at multiples of it: a whole prefill's own calls

    def prefill(self, slot: int, tokens: Sequence[int], final: bool, with_hidden: bool = False,
                taps: tuple[int, ...] = ()) -> torch.Tensor | None:
        """The next chunk of a prompt into a slot, as `LlamaCppBackend` prefills it: on the repacked twin where the
        model has one (the twin's stream of the same slot, its cache copied into the slot once `final`), in
        `MAX_BATCH` chunks at fixed offsets, so the same kernels, chunks and cells give the same cache. With
        `with_hidden`, the chunk's inputs of the `taps` layers [n, len(taps) * D] (a draft reads them; the twin's
        where the twin prefills)."""
        if self.model.repack:  # no twin: llama.cpp's own kernels already
            return self._score({slot: list(tokens)}, True, self._tapping(with_hidden, taps))[1].get(slot)
        if self._prefiller is None:  # as many streams as here: llama.cpp copies a sequence between equal layouts
            self._prefiller = LlamaCppBatch(self.model.twin(), self.slots, self.n_ctx, self._threads)
        twin = self._prefiller
        if self._lengths[slot] or (twin.length(slot) and not self._prefilling[slot]):
            raise DraftlabError(f"slot {slot} is not empty: a prompt prefills into an empty slot")
        self._prefilling[slot] = True
        hidden = twin._score({slot: list(tokens)}, True, twin._tapping(with_hidden, taps))[1].get(slot)
        if final:
            self._copy_from(twin, slot)
            self._starts[slot], self._lengths[slot] = 0, twin.length(slot)
            twin.rollback(slot, 0)
            self._prefilling[slot] = False
        return hidden

    def score_blocks(self, blocks: dict[int, Block], with_hidden: bool = False, taps: tuple[int, ...] = ()
                     ) -> dict[int, Scores]:
        """Every slot's chain in one decode; logits [n, V] per slot, with `with_hidden` the inputs of the `taps`
        layers [n, len(taps) * D] too. Token trees are refused (a tree's mask within one stream's block is not
        built)."""
        if not all(block.is_chain for block in blocks.values()):
            raise DraftlabError("draftlab serve on llama.cpp scores chains of tokens (token trees are served on torch)")
        logits, hidden = self._score({seq: block.tokens for seq, block in blocks.items()}, False,
                                     self._tapping(with_hidden, taps))
        return {seq: Scores(rows, hidden.get(seq)) for seq, rows in logits.items()}

    def passes(self, lengths: dict[int, int]) -> list[int]:
        """Rows per pass over the weights: llama.cpp decodes blocks of unequal length, or of slots with a gap
        between them, in passes of their own (`draftlab.decoding.kchoice.llama_passes`)."""
        return llama_passes(lengths, MAX_BATCH)

    def score(self, blocks: dict[int, Sequence[int]], last_only: bool = False) -> dict[int, torch.Tensor]:
        """Append each slot's chain of tokens in one decode (split in batches of MAX_BATCH tokens); each slot's logits
        [n, V] ([1, V] if last_only)."""
        return self._score(blocks, last_only, ())[0]

    def _tapping(self, with_hidden: bool, taps: tuple[int, ...]) -> tuple[int, ...]:
        """The layers to tap for a call (none without `with_hidden`); llama.cpp hands over no final hidden states."""
        if with_hidden and not taps:
            raise DraftlabError("llama.cpp hands over the inputs of chosen target layers (EAGLE-3 drafts), not the "
                                "final hidden states feature drafts and decoder heads read: serve them on torch")
        return tuple(taps) if with_hidden else ()

    def _score(self, blocks: dict[int, Sequence[int]], last_only: bool, taps: tuple[int, ...]
               ) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
        """`score`, and with `taps` each slot's inputs of those layers [n, len(taps) * D] for every token."""
        if not blocks or any(not tokens for tokens in blocks.values()):
            raise DraftlabError("a batch needs at least one token for each slot it scores")
        for slot, tokens in blocks.items():
            if self._lengths[slot] + len(tokens) > self.n_ctx:
                raise DraftlabError(f"slot {slot} holds {self.n_ctx} tokens; {self._lengths[slot] + len(tokens)} "
                                    "asked for")
            self._starts[slot] = self._lengths[slot]
        self.taps.set(taps)
        rows = [(slot, i, token) for slot, tokens in sorted(blocks.items()) for i, token in enumerate(tokens)]
        wanted = [not last_only or i == len(blocks[slot]) - 1 for slot, i, _ in rows]
        parts = [self._decode(rows[s:s + MAX_BATCH], wanted[s:s + MAX_BATCH]) for s in range(0, len(rows), MAX_BATCH)]
        join = lambda tensors: torch.cat(tensors) if len(tensors) > 1 else tensors[0]  # noqa: E731
        logits = join([part[0] for part in parts])  # [wanted rows, V] in batch order
        for slot, tokens in blocks.items():
            self._lengths[slot] += len(tokens)
        hidden = self._per_slot(join([part[1] for part in parts]), rows, [True] * len(rows)) if taps else {}
        return self._per_slot(logits, rows, wanted), hidden

    def synchronize(self) -> None:
        """Wait for llama.cpp's threads."""
        self.lib.llama_synchronize(self._ctx)

    # llama.cpp ---------------------------------------------------------------------------------------------------

    def _decode(self, rows: list[tuple[int, int, int]], wanted: list[bool]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One llama_decode of (slot, index in its block, token) rows; the wanted rows' logits [m, V] and every row's
        tapped layer inputs [rows, D'] (None untapped)."""
        batch = self._batch
        batch.n_tokens = len(rows)
        for i, ((slot, index, token), out) in enumerate(zip(rows, wanted)):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, self._lengths[slot] + index, 1, out
            batch.seq_id[i][0] = slot
        status = self.lib.llama_decode(self._ctx, batch)
        self.decodes += 1
        if status != 0:
            raise DraftlabError(f"llama_decode failed with status {status} ({len(rows)} tokens of a batch)")
        pointer = self.lib.llama_get_logits(self._ctx)
        logits = torch.from_numpy(np.ctypeslib.as_array(pointer, shape=(sum(wanted), self.vocab_size)).copy())
        return logits, self.taps.read(len(rows))

    @staticmethod
    def _per_slot(logits: torch.Tensor, rows: list[tuple[int, int, int]], wanted: list[bool]
                  ) -> dict[int, torch.Tensor]:
        """Batch-ordered rows [m, ...] of the wanted rows, split by slot (a slot's rows are consecutive)."""
        slots = [slot for (slot, _, _), keep in zip(rows, wanted) if keep]  # [m]
        first = {slot: slots.index(slot) for slot in dict.fromkeys(slots)}
        return {slot: logits[start:start + slots.count(slot)] for slot, start in first.items()}  # [n, V] each

    def _copy_from(self, twin: "LlamaCppBatch", slot: int) -> None:
        """Copy the twin's cache of the same slot into the slot (llama.cpp's sequence state, byte for byte)."""
        size = self.lib.llama_state_seq_get_size(twin._ctx, slot)
        state = (ctypes.c_uint8 * size)()
        written = self.lib.llama_state_seq_get_data(twin._ctx, state, size, slot)
        if not written or self.lib.llama_state_seq_set_data(self._ctx, state, written, slot) == 0:
            raise DraftlabError("llama.cpp could not copy a prefilled cache into a slot")

    def _new_context(self, threads: int):
        params = self.lib.llama_context_default_params()
        params.n_ctx = self.n_ctx * self.slots
        params.n_batch = params.n_ubatch = MAX_BATCH
        params.n_seq_max = self.slots
        params.kv_unified = False  # a KV stream per slot: its cells in position order from cell 0, as alone
        params.n_threads = params.n_threads_batch = threads
        params.flash_attn_type = self.lib.LLAMA_FLASH_ATTN_TYPE_DISABLED  # as LlamaCppBackend: exact rows
        params.no_perf = True
        ctx = self.lib.llama_init_from_model(self.model.handle, params)
        if not ctx:
            raise DraftlabError(f"llama.cpp could not create {self.slots} slots of {self.n_ctx} tokens for "
                                f"{self.model.path}")
        return ctx

    def __del__(self) -> None:
        free_native(self)


class SlotView:
    """One slot of a `LlamaCppBatch` as a `Backend` (chains only): the engine prefills, keeps and rolls it back as a
    backend of its own; the scheduler scores every slot's block together (`LlamaCppBatch.score`)."""

    greedy_chain = greedy_rows  # a draft's greedy tokens, one `score` each

    def __init__(self, batch: LlamaCppBatch, slot: int) -> None:
        self.batch, self.slot = batch, slot
        self.provides_hidden = batch.taps.available  # the inputs of tapped layers only, as `LlamaCppBackend`
        self.vocab_size = batch.vocab_size
        self.batch_invariant = batch.batch_invariant
        self.numerics = batch.numerics

    @property
    def cache_len(self) -> int:
        """Tokens cached in the slot."""
        return self.batch.length(self.slot)

    def reset(self) -> None:
        """Empty the slot."""
        self.batch.rollback(self.slot, 0)

    def rollback(self, length: int) -> None:
        """Keep only the slot's first `length` tokens."""
        self.batch.rollback(self.slot, length)

    def score(self, token_ids: Sequence[int], last_only: bool = False) -> torch.Tensor:
        """Append consecutive tokens to the slot; logits [n, V] (or [1, V] if last_only)."""
        return self.score_block(Block.chain(list(token_ids)), last_only=last_only).logits

    def score_block(self, block: Block, with_hidden: bool = False, last_only: bool = False,
                    taps: tuple[int, ...] = ()) -> Scores:
        """A chain alone in the batch (with `with_hidden`, the `taps` layers' inputs [n, len(taps) * D] too); a prompt
        into an empty slot prefills as `LlamaCppBackend` does."""
        if last_only and self.cache_len == 0 and len(block.tokens) > 1:  # a whole prompt, in the batch's chunks
            chunk = self.batch.prefill_chunk
            hidden = [self.batch.prefill(self.slot, block.tokens[start:start + chunk],
                                         start + chunk >= len(block.tokens), with_hidden, taps)
                      for start in range(0, len(block.tokens), chunk)]  # each [n, D'] or None
            return Scores(torch.empty(0), torch.cat(hidden) if with_hidden else None)  # a prefill's logits unread
        return self.batch.score_blocks({self.slot: block}, with_hidden, taps)[self.slot]

    def keep(self, indices: Sequence[int]) -> None:
        """Keep the root and the accepted path of the last chain (indices 0..m-1)."""
        self.batch.keep(self.slot, len(indices))

    def row_check(self) -> str:
        """Nothing checked op by op: the batch's numerics say what its rows promise."""
        return ""

    def exact_rows(self, block: Block) -> set[int]:
        """Every row of a chain."""
        return set(range(len(block.tokens)))

    def synchronize(self) -> None:
        """Wait for llama.cpp's threads."""
        self.batch.synchronize()
