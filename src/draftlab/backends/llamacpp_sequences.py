"""llama.cpp as draftlab's backend: a GGUF model's sequences in one `llama_context`, each bitwise as it decodes alone.

The one llama.cpp backend, for one sequence and for many. `draftlab generate`, a study's cell and a draft model run
one sequence (`LlamaCppBackend`, sequence 0 of a `LlamaCppSequences` of one); `draftlab serve` runs a sequence per
request in flight, every sequence's block in one `llama_decode` (`score_blocks`). The same calls prefill, score,
keep and roll back both.

Cells: with several sequences each holds a KV stream of its own (`kv_unified = False`, as llama-server's slots do):
its cells start at cell 0 of its stream and lie in position order, exactly where its cells lie when it decodes
alone. In a unified cache the cells of other sequences would interleave with its own and shift how attention's SIMD
lanes split the sum over cells, even masked out. A token tree's leaves are sequences sharing its sequence's cells
(`draftlab.backends.llamacpp_trees`): one sequence holds one unified stream, whose other sequences they are; with a
stream per sequence, the sequences draftlab's stream-leaves patch puts in its stream, so that every request's tree
and chain verify in one decode.

Exactness: with the exact kernels (`LlamaCppModel.rows_exact`) each product row keeps its order of additions at
every row count, and with flash attention off (its CPU kernel reduces over the cache differently for one row and
for several once the cache passes ~256 cells) every row of a decode is bitwise that row scored alone, provided the
visible cells lie in position order. llama.cpp splits a decode of several streams into ubatches of an equal number
of tokens per sequence and consecutive sequence ids (`llama_batch_allocr::split_equal`): blocks of unequal length
or a gap between sequences cost extra passes over the weights, never exactness.

A prompt prefills on the model's repacked twin where it has one (its cache then copied into the sequence,
`llama_state_seq_get_data`/`set_data`), in `MAX_BATCH` chunks at fixed offsets: plain and speculative decoding,
alone and served, build the same cache. Layer inputs (what EAGLE-3 drafts read) are recorded by llama.cpp itself at
every decode (`LayerTaps`), split by sequence as the logits are.
"""

from __future__ import annotations

import ctypes
import warnings
from typing import Sequence

import numpy as np
import torch

from draftlab.backends.base import ROUNDING, greedy_rows
from draftlab.backends.gguf import (INSTALL_HINT, LlamaCppModel, free_native, greedy_chain_call, llama_lib,
                                    sequence_ids)
from draftlab.backends.gguf import threads as default_threads
from draftlab.backends.llamacpp_taps import LayerTaps
from draftlab.backends.llamacpp_trees import MAX_LEAVES, Rows, TreeCells, leaf_ids
from draftlab.decoding.kchoice import llama_passes
from draftlab.decoding.step import Block, Scores
from draftlab.errors import DraftlabError

MAX_CONTEXT = 8192  # KV cells per sequence (the model's training context if smaller)
MAX_BATCH = 512  # tokens per llama_decode call (a longer block is split)


class LlamaCppSequences:
    """A GGUF model in llama.cpp holding `count` sequences, each in cells of its own."""

    prefill_chunk = MAX_BATCH  # prompt tokens a chunk prefills, at multiples of it: a whole prefill's own calls

    def __init__(self, model: LlamaCppModel, count: int = 1, context: int | None = None, threads: int | None = None
                 ) -> None:
        """`context`: the cells of each sequence (default: the model's training context, at most 8192); `threads`:
        llama.cpp's (default: the cores this process may use; each row's sums keep their order at any count)."""
        if count < 1:
            raise DraftlabError(f"a llama.cpp backend holds at least one sequence, got {count}")
        self.lib = llama_lib()
        self.model, self.count = model, count
        self.vocab_size = model.vocab_size
        self.out_rows = model.head_rows or model.vocab_size  # logits per row: a trimmed head's rows (a cut draft)
        self.batch_invariant = model.rows_exact
        self.numerics = numerics_of(model)
        self._ids = MAX_LEAVES + 1 if count == 1 else sequence_ids()  # sequence ids the context takes (0: `count`)
        self.trees = self._ids > count  # a tree's leaves share its sequence's cells (a unified stream, or the patch)
        self.n_ctx = min(context or MAX_CONTEXT, model.n_ctx_train, MAX_CONTEXT)
        self._threads = threads or default_threads()
        self._ctx = self._new_context()
        self._memory = self.lib.llama_get_memory(self._ctx)
        self.taps = LayerTaps(self.lib, model, self._ctx)  # target layers whose inputs each decode records (EAGLE-3)
        self._batch = self.lib.llama_batch_init(MAX_BATCH, 0, MAX_LEAVES if self.trees else 1)
        self._lengths = [0] * count  # cached tokens per sequence
        self._starts = [0] * count  # where each sequence's last scored block began
        self._trees: dict[int, TreeCells] = {}  # each sequence's last block, where it was a tree
        self._prefiller: LlamaCppSequences | None = None  # the repacked twin's sequences, for prefills
        self._prefilling = [False] * count  # a prompt part-prefilled in the twin's cells of the sequence
        self._table: tuple[torch.Tensor, np.ndarray] | None = None  # row_tokens and their int32 copy (greedy_chain)
        self.decodes = 0  # llama_decode calls on this context (a served draft's: one per draft position a step)

    @property
    def keeps_prefixes(self) -> bool:
        """On the exact kernels without a twin (the model loaded repacked, rows as alone at every row count), a
        token's cells are the same whether a prefill chunk or a step's block computed them: a sequence's cells serve
        a later prompt that starts with its tokens (a chat's next turn), as a prefill of them would."""
        return self.model.rows_exact and self.model.repack

    def view(self, seq: int) -> "SequenceView":
        """The sequence as a `Backend`, for its engine."""
        return SequenceView(self, seq)

    def length(self, seq: int) -> int:
        """Tokens cached in a sequence."""
        return self._lengths[seq]

    def rollback(self, seq: int, length: int) -> None:
        """Keep only the first `length` tokens of a sequence (0: empty, a prompt's prefill on the twin dropped too; a
        tree block not kept: its leaf sequences go)."""
        tree = self._trees.pop(seq, None)
        if tree is not None:
            for leaf in tree.leaf_seqs:
                self.lib.llama_memory_seq_rm(self._memory, leaf, -1, -1)
        if length == 0 and self._prefilling[seq]:
            self._prefiller.rollback(seq, 0)
            self._prefilling[seq] = False
        if length < self._lengths[seq]:
            self.lib.llama_memory_seq_rm(self._memory, seq, length, -1)
            self._lengths[seq] = length

    def keep(self, seq: int, indices: Sequence[int]) -> None:
        """Keep a sequence's cache before its last block plus the block's tokens at `indices` (ascending: a chain's
        root and accepted path, or a tree's)."""
        indices, base, tree = list(indices), self._starts[seq], self._trees.get(seq)
        if tree is None:  # a chain's kept tokens are its first
            self.rollback(seq, base + len(indices))
            return
        self.lib.llama_memory_seq_cp(self._memory, tree.path_seq[indices[-1]], seq, base, base + len(indices))
        self.rollback(seq, base + len(indices))  # the leaf sequences go
        in_place = tree.scattered(indices)
        if in_place < len(indices):  # scattered cells: score the rest of the path again, into contiguous cells
            self.rollback(seq, base + in_place)
            self._score({seq: Block.chain([tree.tokens[i] for i in indices[in_place:]])}, True, ())

    def prefill(self, seq: int, tokens: Sequence[int], final: bool, with_hidden: bool = False,
                taps: tuple[int, ...] = ()) -> torch.Tensor | None:
        """The next chunk of a prompt into a sequence: on the repacked twin where the model has one (the twin's
        cells of the same sequence, copied into the sequence once `final`), so the same kernels, chunks and cells
        give the same cache alone and served. With `with_hidden`, the chunk's inputs of the `taps` layers
        [n, len(taps) * D] (a draft reads them; the twin's where the twin prefills)."""
        return self.prefill_part(seq, tokens, final, with_hidden, taps).hidden

    def score_blocks(self, blocks: dict[int, Block], with_hidden: bool = False, taps: tuple[int, ...] = (),
                     last_only: bool = False) -> dict[int, Scores]:
        """Every sequence's block, a chain or a token tree, in one decode; logits [n, V] per sequence in block order
        ([1, V] with `last_only`, a chain's), with `with_hidden` the inputs of the `taps` layers [n, len(taps) * D]
        too."""
        taps = self._tapping(with_hidden, taps)
        if not self.trees and not all(block.is_chain for block in blocks.values()):
            raise DraftlabError("this llama.cpp library verifies token trees in a backend of one sequence only: "
                                "rebuild it with scripts/build-llama-cpp.sh (draftlab's stream-leaves patch)")
        logits, hidden = self._score(blocks, last_only, taps)
        return {seq: Scores(rows, hidden.get(seq)) for seq, rows in logits.items()}

    def passes(self, lengths: dict[int, int]) -> list[int]:
        """Rows per pass over the weights: llama.cpp decodes blocks of unequal length, or of sequences with a gap
        between them, in passes of their own (`draftlab.decoding.kchoice.llama_passes`)."""
        return llama_passes(lengths, MAX_BATCH)

    def score(self, blocks: dict[int, Sequence[int]], last_only: bool = False) -> dict[int, torch.Tensor]:
        """Append each sequence's chain of tokens in one decode (split in batches of MAX_BATCH tokens); each
        sequence's logits [n, V] ([1, V] if last_only)."""
        return self._score({seq: Block.chain(list(tokens)) for seq, tokens in blocks.items()}, last_only, ())[0]

    def greedy_chain(self, seq: int, token: int, n: int, row_tokens: torch.Tensor | None) -> list[int] | None:
        """n greedy tokens after `token` in sequence 0, in one call into llama.cpp where libllama holds draftlab's
        draft loop (`greedy_chain_call`: one-token decodes and picks, no round trip to Python a token); None where
        it cannot (another sequence, a library without it)."""
        call = greedy_chain_call()
        if call is None or n <= 0 or seq != 0:
            return None
        start = self._begin({0: n})[0]
        picks = np.empty(n, dtype=np.int32)  # [n]
        table = None if row_tokens is None else self._row_table(row_tokens)  # [V'] int32
        status = call(self._ctx, token, start, n, self.out_rows, None if table is None else table.ctypes.data,
                      picks.ctypes.data)
        self._lengths[0] += n if status == n else -status - 1  # tokens fed before a failed decode stay cached
        if status != n:
            raise DraftlabError(f"llama_decode failed drafting token {-status} of {n} after {start}")
        return picks.tolist()

    def synchronize(self) -> None:
        """Wait for llama.cpp's threads."""
        self.lib.llama_synchronize(self._ctx)

    # blocks ------------------------------------------------------------------------------------------------------

    def _tapping(self, with_hidden: bool, taps: tuple[int, ...]) -> tuple[int, ...]:
        """The layers to tap for a call (none without `with_hidden`); llama.cpp hands over no final hidden states."""
        if with_hidden and not taps:
            raise DraftlabError("llama.cpp hands over the inputs of chosen target layers (EAGLE-3 drafts), not the "
                                "final hidden states feature drafts and decoder heads read: use --backend fast")
        return tuple(taps) if with_hidden else ()

    def _begin(self, lengths: dict[int, int]) -> dict[int, int]:
        """Mark where each sequence's next block of `lengths` tokens starts (a one-line error past its cells)."""
        for seq, n in lengths.items():
            if self._lengths[seq] + n > self.n_ctx:
                raise DraftlabError(f"the llama.cpp context holds {self.n_ctx} tokens a sequence; "
                                    f"{self._lengths[seq] + n} asked for")
            self._starts[seq] = self._lengths[seq]
        return {seq: self._starts[seq] for seq in lengths}

    def _score(self, blocks: dict[int, Block], last_only: bool, taps: tuple[int, ...]
               ) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
        """Blocks appended in one decode (split in MAX_BATCH tokens): each sequence's logits [n, V] in block order
        ([1, V] for a chain if last_only), and with `taps` its inputs of those layers [n, len(taps) * D]."""
        if not blocks or any(not block.tokens for block in blocks.values()):
            raise DraftlabError("a block needs at least one token for each sequence it scores")
        starts = self._begin({seq: len(block.tokens) for seq, block in blocks.items()})
        self.taps.set(taps)
        rows = {seq: self._lay_out(seq, block, starts[seq], last_only) for seq, block in sorted(blocks.items())}
        owners = [seq for seq, laid in rows.items() for _ in laid.tokens]  # [rows] each row's sequence
        batch = Rows.joined(list(rows.values()))
        parts = [self._decode(batch.tokens[s:s + MAX_BATCH], batch.positions[s:s + MAX_BATCH],
                              batch.seqs[s:s + MAX_BATCH], batch.wanted[s:s + MAX_BATCH])
                 for s in range(0, len(batch.tokens), MAX_BATCH)]
        for seq, block in blocks.items():
            self._lengths[seq] += len(block.tokens)
        logits = per_sequence(join([part[0] for part in parts]),
                              [seq for seq, out in zip(owners, batch.wanted) if out])
        hidden = per_sequence(join([part[1] for part in parts]), owners) if taps else {}
        return ({seq: rows[seq].in_block_order(x) for seq, x in logits.items()},
                {seq: rows[seq].in_block_order(x) for seq, x in hidden.items()})

    def _lay_out(self, seq: int, block: Block, start: int, last_only: bool) -> "Rows":
        """A sequence's rows in the decode: a chain's in order from `start`; a tree's depth first, in its leaves'
        sequences (given the sequence's cache first), each at `start` + its depth."""
        if block.is_chain:
            return Rows.chain(seq, block.tokens, start, last_only)
        cells = TreeCells.of(block, leaf_ids(seq, self.count, self._ids))
        for leaf in cells.leaf_seqs:
            self.lib.llama_memory_seq_cp(self._memory, seq, leaf, -1, -1)
        self._trees[seq] = cells
        return cells.laid_out(start)

    def prefill_part(self, seq: int, tokens: Sequence[int], final: bool, with_hidden: bool = False,
                     taps: tuple[int, ...] = ()) -> Scores:
        """`prefill`, with the chunk's last row's logits [1, V]."""
        tokens, taps = list(tokens), self._tapping(with_hidden, taps)
        if self.model.repack:  # no twin: llama.cpp's own kernels already
            logits, hidden = self._score({seq: Block.chain(tokens)}, True, taps)
            return Scores(logits[seq], hidden.get(seq))
        if self._prefiller is None:  # as many sequences as here: llama.cpp copies a sequence between equal layouts
            self._prefiller = LlamaCppSequences(self.model.twin(), self.count, self.n_ctx, self._threads)
        twin = self._prefiller
        if self._lengths[seq] or (twin.length(seq) and not self._prefilling[seq]):
            raise DraftlabError(f"sequence {seq} is not empty: a prompt prefills into an empty sequence")
        self._prefilling[seq] = True
        logits, hidden = twin._score({seq: Block.chain(tokens)}, True, taps)
        if final:
            self._copy_from(twin, seq)
            self._starts[seq], self._lengths[seq] = 0, twin.length(seq)
            twin.rollback(seq, 0)
            self._prefilling[seq] = False
        return Scores(logits[seq], hidden.get(seq))

    def _row_table(self, row_tokens: torch.Tensor) -> np.ndarray:
        """`row_tokens` [V'] as int32 for llama.cpp, converted once per tensor."""
        if self._table is None or self._table[0] is not row_tokens:
            self._table = row_tokens, np.ascontiguousarray(row_tokens.cpu().numpy(), dtype=np.int32)
        return self._table[1]

    # llama.cpp ---------------------------------------------------------------------------------------------------

    def _decode(self, tokens: list[int], positions: list[int], seqs: list[list[int]], wanted: list[bool]
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One llama_decode of rows (token, position, sequences); the wanted rows' logits [m, V'] and every row's
        tapped layer inputs [rows, D'] (None untapped)."""
        batch = self._batch
        batch.n_tokens = len(tokens)
        for i, (token, pos, seq_ids, out) in enumerate(zip(tokens, positions, seqs, wanted)):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, pos, len(seq_ids), out
            for j, seq in enumerate(seq_ids):
                batch.seq_id[i][j] = seq
        status = self.lib.llama_decode(self._ctx, batch)
        self.decodes += 1
        if status != 0:
            raise DraftlabError(f"llama_decode failed with status {status} ({len(tokens)} tokens of a batch)")
        pointer = self.lib.llama_get_logits(self._ctx)
        logits = np.ctypeslib.as_array(pointer, shape=(sum(wanted), self.vocab_size))[:, :self.out_rows]  # [m, V']
        return torch.from_numpy(logits.copy()), self.taps.read(len(tokens))  # a copy: the buffer is llama.cpp's

    def _copy_from(self, twin: "LlamaCppSequences", seq: int) -> None:
        """Copy the twin's cache of the same sequence into the sequence (llama.cpp's sequence state, byte for byte)."""
        size = self.lib.llama_state_seq_get_size(twin._ctx, seq)
        state = (ctypes.c_uint8 * size)()
        written = self.lib.llama_state_seq_get_data(twin._ctx, state, size, seq)
        if not written or self.lib.llama_state_seq_set_data(self._ctx, state, written, seq) == 0:
            raise DraftlabError("llama.cpp could not copy a prefilled cache between contexts")

    def _new_context(self):
        if not self.model.rows_exact and not self.model.repack:
            warnings.warn("this llama.cpp build has llamafile's sgemm gated to 2+ rows: rows of a block round "
                          "differently from single rows, so greedy speculative output may differ from plain decoding; "
                          f"reinstall with {INSTALL_HINT.removeprefix('install it with ')}", stacklevel=3)
        params = self.lib.llama_context_default_params()
        params.n_ctx = self.n_ctx * self.count
        params.n_batch = params.n_ubatch = MAX_BATCH
        params.n_seq_max = self._ids if self.count == 1 else self.count  # a stream each (the patch: their leaves too)
        params.kv_unified = self.count == 1  # else a KV stream per sequence: its cells in position order from cell 0
        params.n_threads = params.n_threads_batch = self._threads
        params.flash_attn_type = self.lib.LLAMA_FLASH_ATTN_TYPE_DISABLED  # exact rows (above)
        params.no_perf = True
        ctx = self.lib.llama_init_from_model(self.model.handle, params)
        if not ctx:
            raise DraftlabError(f"llama.cpp could not create {self.count} sequences of {self.n_ctx} tokens for "
                                f"{self.model.path}")
        return ctx

    def __del__(self) -> None:
        free_native(self)


class SequenceView:
    """One sequence of a `LlamaCppSequences` as a `Backend`: its engine prefills, scores, keeps and rolls it back as
    a backend of its own; `draftlab serve`'s step scores every sequence's block together (`score_blocks`)."""

    def __init__(self, sequences: LlamaCppSequences, seq: int) -> None:
        self.sequences, self.seq = sequences, seq
        self.provides_hidden = sequences.taps.available  # the inputs of tapped layers only (not final hidden states)
        self.vocab_size = sequences.vocab_size
        self.batch_invariant = sequences.batch_invariant
        self.numerics = sequences.numerics
        self.n_ctx = sequences.n_ctx

    @property
    def cache_len(self) -> int:
        """Tokens cached in the sequence."""
        return self.sequences.length(self.seq)

    def reset(self) -> None:
        """Empty the sequence."""
        self.sequences.rollback(self.seq, 0)

    def rollback(self, length: int) -> None:
        """Keep only the sequence's first `length` tokens."""
        self.sequences.rollback(self.seq, length)

    def score(self, token_ids: Sequence[int], last_only: bool = False) -> torch.Tensor:
        """Append consecutive tokens to the sequence; logits [n, V] (or [1, V] if last_only)."""
        return self.score_block(Block.chain(list(token_ids)), last_only=last_only).logits

    def score_block(self, block: Block, with_hidden: bool = False, last_only: bool = False,
                    taps: tuple[int, ...] = ()) -> Scores:
        """Append a block (a chain, or a tree where the backend `trees`) in one pass; logits [n, V] ([1, V] if
        last_only), with `with_hidden` the `taps` layers' inputs [n, len(taps) * D] too. A prompt into an empty
        sequence prefills in the backend's chunks, as a served prompt does."""
        if block.is_chain and last_only and self.cache_len == 0 and len(block.tokens) > 1:
            return self._prefill(block.tokens, with_hidden, taps)
        return self.sequences.score_blocks({self.seq: block}, with_hidden, taps, last_only)[self.seq]

    def keep(self, indices: Sequence[int]) -> None:
        """Keep the cache before the last block plus the block's tokens at `indices` (ascending)."""
        self.sequences.keep(self.seq, indices)

    def greedy_chain(self, token: int, n: int, row_tokens: torch.Tensor | None = None) -> list[int]:
        """n greedy tokens after `token`: in one call into llama.cpp where it can (`LlamaCppSequences.greedy_chain`),
        else one `score` a token."""
        picks = self.sequences.greedy_chain(self.seq, token, n, row_tokens)
        return greedy_rows(self, token, n, row_tokens) if picks is None else picks

    def row_check(self) -> str:
        """Nothing checked op by op here: the backend's numerics already say what its rows promise."""
        return ""

    def exact_rows(self, block: Block) -> set[int]:
        """A chain's every row; in a tree, the root's first-child path only: the other branches' cells are shifted
        from their positions, and llama.cpp's attention sums over cells in SIMD lanes by cell index."""
        if block.is_chain or not self.batch_invariant:
            return set(range(len(block.tokens)))
        children, rows, node = block.layout().children, {0}, 0
        while children[node]:
            node = children[node][0]
            rows.add(node)
        return rows

    def synchronize(self) -> None:
        """Wait for llama.cpp's threads."""
        self.sequences.synchronize()

    def _prefill(self, tokens: list[int], with_hidden: bool, taps: tuple[int, ...]) -> Scores:
        """A whole prompt in the backend's chunks; its last row's logits [1, V] (and every row's tapped inputs)."""
        chunk = self.sequences.prefill_chunk
        parts = [self.sequences.prefill_part(self.seq, tokens[start:start + chunk], start + chunk >= len(tokens),
                                             with_hidden, taps)
                 for start in range(0, len(tokens), chunk)]
        return Scores(parts[-1].logits, torch.cat([part.hidden for part in parts]) if with_hidden else None)


def numerics_of(model: LlamaCppModel) -> str:
    """What a model's products are, for the records (and that they round apart where its rows are not exact)."""
    return model.kernels() + ("" if model.rows_exact else f" ({ROUNDING})")


def per_sequence(rows: torch.Tensor, seqs: list[int]) -> dict[int, torch.Tensor]:
    """Rows [m, ...] in batch order split by sequence (`seqs` [m]: each row's; a sequence's rows are consecutive)."""
    first = {seq: seqs.index(seq) for seq in dict.fromkeys(seqs)}
    return {seq: rows[start:start + seqs.count(seq)] for seq, start in first.items()}  # [n, ...] each


def join(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Parts of one call's rows, in order."""
    return torch.cat(tensors) if len(tensors) > 1 else tensors[0]

