"""llama.cpp as a backend: GGUF targets and drafts scored by llama.cpp's own kernels, quantized as they are.

One `llama_context` per backend (its own KV cache); target and draft share nothing but the tokenizer. Blocks go
through `llama_decode` with logits only for the rows verification needs (a prefill asks for none but its last).

Token trees use llama.cpp's sequence sets, as its own speculative examples do: the cache before the block
belongs to sequence 0 and is shared (`llama_memory_seq_cp`) with one sequence per leaf; a block token belongs to
the sequences of the leaves below it, and llama.cpp's mask lets a token see exactly the cells of its first
sequence, i.e. the cache, its ancestors and itself. `keep` gives the accepted path back to sequence 0 and drops
the leaf sequences.

Exactness: with the kernel settings of `draftlab.backends.gguf` and flash attention off, every row of a block is
bitwise the row scored alone (flash attention's CPU kernel reduces over the cache differently for one row and for
several once the cache passes ~256 cells), provided the visible cells lie in position order (llama.cpp sums
attention over cells in cell order).
A tree's accepted path is in position order inside the block, but when it is not the block's first rows
its cells are scattered; `keep` then re-scores those tokens as a chain into contiguous cells (an extra pass of
at most K tokens, only on such steps). The block order put first children first (`dfs_order`), so the draft's
own top path, the usual accepted one, needs no extra pass.

Hidden states: the inputs of chosen target layers (`taps`, what EAGLE-3 drafts read), recorded by llama.cpp itself
at every decode (`layer_input_calls`: the calls its own EAGLE-3 drafting uses; the graph only marks those tensors as
outputs, so the logits are those of a decode without them). Not the final hidden states that feature drafts and
decoder heads read: llama.cpp's embeddings are post-norm and need a context of their own.
"""

from __future__ import annotations

import ctypes
import warnings
from typing import Sequence

import numpy as np
import torch

from draftlab.backends.base import ROUNDING, greedy_rows
from draftlab.backends.gguf import INSTALL_HINT, LlamaCppModel, greedy_chain_call, llama_lib, threads
from draftlab.backends.llamacpp_taps import LayerTaps
from draftlab.errors import DraftlabError
from draftlab.decoding.step import Block, Scores

MAX_CONTEXT = 8192  # KV cells per context (the model's training context if smaller)
MAX_BATCH = 512  # tokens per llama_decode call (a longer prefill is split)
MAX_LEAVES = 64  # leaf sequences of a token tree


class LlamaCppBackend:
    """A GGUF model in llama.cpp with its own context and KV cache, batch size 1."""

    def __init__(self, model: LlamaCppModel, device: str = "cpu", batch_invariant: bool | None = None,
                 head_rows: torch.Tensor | None = None, flash_attention: bool = False, fast_prefill: bool = True) -> None:
        """`batch_invariant` is accepted for the registry's sake: rows are exact whenever the library's kernels are
        (`LlamaCppModel.kernels`). `head_rows` [V'] (a cut draft): the model's GGUF holds a head of exactly those
        rows (`draftlab.backends.gguf_head`), and logits are [n, V'].

        `fast_prefill`: a model on exact kernels prefills a prompt on its repacked twin (`LlamaCppModel.twin`) and
        takes the sequence's cache over (`llama_state_seq_get_data`/`set_data`): plain and speculative decoding
        prefill alike, so their caches stay identical, and repacked prefills run up to ~1.7x faster."""
        if str(device) != "cpu":
            raise DraftlabError(f"the llamacpp backend runs on the CPU here, not {device}")
        check_head(model, head_rows)
        self.lib = llama_lib()
        self.model = model
        self.vocab_size = model.vocab_size
        self.out_rows = model.head_rows or model.vocab_size  # logits per row: the GGUF's head rows
        self.batch_invariant = model.rows_exact
        if not model.rows_exact and not model.repack:
            warnings.warn("this llama.cpp build has llamafile's sgemm gated to 2+ rows: rows of a block round "
                          "differently from single rows, so greedy speculative output may differ from plain decoding; "
                          f"reinstall with {INSTALL_HINT.removeprefix('install it with ')}", stacklevel=2)
        self.numerics = self.numerics_of(model)
        self.n_ctx = min(model.n_ctx_train, MAX_CONTEXT)
        self._ctx = self._new_context(flash_attention)
        self._memory = self.lib.llama_get_memory(self._ctx)
        self._taps = LayerTaps(self.lib, model, self._ctx)  # the layers whose inputs llama.cpp records, each decode
        self.provides_hidden = self._taps.available  # the inputs of tapped layers only (see above)
        self._batch = self.lib.llama_batch_init(MAX_BATCH, 0, MAX_LEAVES)
        self._len = 0
        self._remember([], [], None)
        self._fast_prefill = fast_prefill and not model.repack
        self._prefiller: LlamaCppBackend | None = None
        self._rows_of: torch.Tensor | None = None  # the row_tokens whose int32 copy `_table` is (`greedy_chain`)
        self._table: np.ndarray | None = None

    @staticmethod
    def numerics_of(model: LlamaCppModel) -> str:
        """What a model's products are, for the records (and that they round apart where its rows are not exact)."""
        return model.kernels() + ("" if model.rows_exact else f" ({ROUNDING})")

    @property
    def context(self):
        """The llama_context (a `LlamaCppBatch` copies a prefilled cache out of it)."""
        return self._ctx

    @property
    def cache_len(self) -> int:
        """Number of tokens currently held in the cache."""
        return self._len

    def reset(self) -> None:
        """Empty the cache."""
        self.lib.llama_memory_clear(self._memory, True)
        self._len = 0
        self._remember([], [], None)

    def rollback(self, length: int) -> None:
        """Keep only the first `length` cached tokens."""
        if self._tree is not None:  # a tree block not kept: its leaf sequences go
            for s in self._tree[0].values():
                self.lib.llama_memory_seq_rm(self._memory, s, -1, -1)
            self._tree = None
        if length < self._len:
            self.lib.llama_memory_seq_rm(self._memory, 0, length, -1)
            self._len = length

    def synchronize(self) -> None:
        """Wait for llama.cpp's threads."""
        self.lib.llama_synchronize(self._ctx)

    def score(self, token_ids: Sequence[int], last_only: bool = False) -> torch.Tensor:
        """Append consecutive tokens to the cache; logits [n, V] (or [1, V] if last_only), fp32."""
        return self.score_block(Block.chain(list(token_ids)), last_only=last_only).logits

    def score_block(self, block: Block, with_hidden: bool = False, last_only: bool = False,
                    taps: tuple[int, ...] = ()) -> Scores:
        """Append a tree-shaped block in one pass; logits [n, V] ([1, V] if last_only); with `with_hidden`, the
        inputs of the `taps` layers [n, len(taps) * D] too."""
        if with_hidden and not taps:
            raise DraftlabError("llama.cpp hands over the inputs of chosen target layers (EAGLE-3 drafts), not the "
                                "final hidden states feature drafts and decoder heads read: use --backend fast")
        self._taps.set(tuple(taps) if with_hidden else ())
        if (block.is_chain and last_only and self._fast_prefill and self._len == 0 and len(block.tokens) > 1
                and not self._taps.layers):
            return Scores(self._prefill_on_twin(block.tokens))
        if block.is_chain:
            return self._score_chain(block.tokens, last_only)
        return self._score_tree(block)

    def keep(self, indices: Sequence[int]) -> None:
        """Keep the cache before the last block plus the block's tokens at `indices` (ascending)."""
        indices = list(indices)
        base = self._block_start
        if self._tree is not None:
            self._path_to_seq0(base, indices)
            self._tree = None
        self.rollback(base + len(indices))
        rows = [self._rows[i] for i in indices]  # batch rows (= cells after the cache) of the kept tokens
        in_place = next((j for j, row in enumerate(rows) if row != j), len(rows))
        if in_place < len(rows):  # scattered cells: re-score the rest of the path into contiguous cells
            tokens = [self._tokens[i] for i in indices[in_place:]]
            self.rollback(base + in_place)
            self._score_chain(tokens, last_only=True)

    def greedy_chain(self, token: int, n: int, row_tokens: torch.Tensor | None = None) -> list[int]:
        """n greedy tokens after `token` in one call into llama.cpp where libllama holds draftlab's draft loop
        (`greedy_chain_call`): the one-token decodes and picks of `greedy_rows`, no round trip to Python a token."""
        call = greedy_chain_call()
        if call is None or n <= 0:
            return greedy_rows(self, token, n, row_tokens)
        if self._len + n > self.n_ctx:
            raise DraftlabError(f"the llama.cpp context holds {self.n_ctx} tokens; {self._len + n} asked for")
        rows = np.empty(n, dtype=np.int32)  # [n] the picks
        table = None if row_tokens is None else self._row_table(row_tokens)  # [V'] int32
        status = call(self._ctx, token, self._len, n, self.out_rows, None if table is None else table.ctypes.data,
                      rows.ctypes.data)
        picks = rows.tolist()
        fed = [token] + [pick if table is None else int(table[pick]) for pick in picks[:-1]]
        done = n if status == n else -status - 1  # tokens in the cache now
        self._remember(fed[:done], list(range(done)), None)
        self._len += done
        if status != n:
            raise DraftlabError(f"llama_decode failed drafting token {done + 1} of {n} after {self._len}")
        return picks

    def _row_table(self, row_tokens: torch.Tensor) -> np.ndarray:
        """`row_tokens` [V'] as int32 for llama.cpp, converted once per tensor."""
        if self._rows_of is not row_tokens:
            self._rows_of, self._table = row_tokens, np.ascontiguousarray(row_tokens.cpu().numpy(), dtype=np.int32)
        return self._table

    def row_check(self) -> str:
        """Nothing checked op by op here: this backend's numerics already say what its rows promise."""
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

    # chains ------------------------------------------------------------------------------------------------------

    def _score_chain(self, tokens: list[int], last_only: bool) -> Scores:
        """Decode consecutive tokens in seq 0, split in batches of MAX_BATCH; logits [n, V] or [1, V] (and the
        tapped layers' inputs [n, len(taps) * D] of every token)."""
        if not tokens:
            raise DraftlabError("a block needs at least one token")
        self._remember(tokens, list(range(len(tokens))), None)
        rows, hidden = [], []
        for start in range(0, len(tokens), MAX_BATCH):
            part = tokens[start:start + MAX_BATCH]
            last = start + len(part) == len(tokens)
            wanted = [(last and i == len(part) - 1) or not last_only for i in range(len(part))]
            self._fill(part, [self._len + i for i in range(len(part))], [[0]] * len(part), wanted)
            self._decode(len(part))
            rows.append(self._logits(sum(wanted)))
            hidden.append(self._taps.read(len(part)))
            self._len += len(part)
        join = lambda parts: parts[0] if len(parts) == 1 else torch.cat(parts)  # noqa: E731
        return Scores(join(rows), join(hidden) if self._taps.layers else None)  # [n, V] or [1, V]; [n, D'] or None

    def _prefill_on_twin(self, tokens: list[int]) -> torch.Tensor:
        """Prefill on the repacked twin, then copy its cache of seq 0 here; the last row's logits [1, V]."""
        if self._prefiller is None:
            self._prefiller = LlamaCppBackend(self.model.twin(), fast_prefill=False)
        twin = self._prefiller
        twin.reset()
        logits = twin._score_chain(tokens, last_only=True).logits  # [1, V]
        size = self.lib.llama_state_seq_get_size(twin._ctx, 0)
        state = (ctypes.c_uint8 * size)()
        written = self.lib.llama_state_seq_get_data(twin._ctx, state, size, 0)
        twin.reset()
        self.reset()
        if not written or self.lib.llama_state_seq_set_data(self._ctx, state, written, 0) == 0:
            raise DraftlabError("llama.cpp could not copy a prefilled cache between contexts")
        self._remember(tokens, list(range(len(tokens))), None)
        self._len = len(tokens)
        return logits

    def _remember(self, tokens: list[int], rows: list[int], tree: tuple | None) -> None:
        """What `keep` needs of the block about to be scored."""
        self._block_start, self._tokens, self._rows, self._tree = self._len, tokens, rows, tree

    # trees -------------------------------------------------------------------------------------------------------

    def _score_tree(self, block: Block) -> Scores:
        """Decode a tree block with one sequence per leaf; logits [n, V] (and tapped inputs) in the block's order."""
        layout = block.layout()
        order = dfs_order(block.parents, layout.children)
        leaves = [i for i in order if not layout.children[i]]
        if len(leaves) >= MAX_LEAVES:
            raise DraftlabError(f"a token tree on llama.cpp may have at most {MAX_LEAVES - 1} leaves, got {len(leaves)}")
        seq_of_leaf = {leaf: s + 1 for s, leaf in enumerate(leaves)}
        below = leaves_below(layout.children, order)
        for s in seq_of_leaf.values():
            self.lib.llama_memory_seq_cp(self._memory, 0, s, -1, -1)
        depths = layout.depths.tolist()
        self._fill([block.tokens[i] for i in order], [self._len + depths[i] for i in order],
                   [[seq_of_leaf[leaf] for leaf in below[i]] for i in order], [True] * len(order))
        self._decode(len(order))
        logits, hidden = self._logits(len(order)), self._taps.read(len(order))  # [n, V], [n, D'] in batch order
        rows = inverse(order)
        self._remember(list(block.tokens), rows, (seq_of_leaf, below))
        self._len += len(order)
        where = torch.tensor(rows)
        return Scores(logits[where], None if hidden is None else hidden[where])  # in block order

    def _path_to_seq0(self, base: int, indices: list[int]) -> None:
        """Add seq 0 to the kept path's cells (through a leaf below its end), then drop every leaf sequence."""
        seq_of_leaf, below = self._tree
        path_seq = seq_of_leaf[below[indices[-1]][0]]
        self.lib.llama_memory_seq_cp(self._memory, path_seq, 0, base, base + len(indices))
        for s in seq_of_leaf.values():
            self.lib.llama_memory_seq_rm(self._memory, s, -1, -1)

    # llama.cpp ---------------------------------------------------------------------------------------------------

    def _new_context(self, flash_attention: bool):
        params = self.lib.llama_context_default_params()
        params.n_ctx = self.n_ctx
        params.n_batch = params.n_ubatch = MAX_BATCH
        params.n_seq_max = MAX_LEAVES
        params.kv_unified = True  # leaf sequences share the cache's cells
        params.n_threads = params.n_threads_batch = threads()
        params.flash_attn_type = (self.lib.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attention
                                  else self.lib.LLAMA_FLASH_ATTN_TYPE_DISABLED)
        params.no_perf = True
        ctx = self.lib.llama_init_from_model(self.model.handle, params)
        if not ctx:
            raise DraftlabError(f"llama.cpp could not create a context of {self.n_ctx} tokens for {self.model.path}")
        return ctx

    def _fill(self, tokens: list[int], positions: list[int], seqs: list[list[int]], wanted: list[bool]) -> None:
        if len(tokens) > MAX_BATCH or any(len(s) > MAX_LEAVES for s in seqs):  # the batch's arrays hold no more
            raise DraftlabError(f"a llama.cpp batch holds {MAX_BATCH} tokens in at most {MAX_LEAVES} sequences each, "
                                f"got {len(tokens)} tokens")
        batch = self._batch
        batch.n_tokens = len(tokens)
        for i, (token, pos, seq_ids, out) in enumerate(zip(tokens, positions, seqs, wanted)):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, pos, len(seq_ids), out
            for j, s in enumerate(seq_ids):
                batch.seq_id[i][j] = s

    def _decode(self, n: int) -> None:
        if self._len + n > self.n_ctx:
            raise DraftlabError(f"the llama.cpp context holds {self.n_ctx} tokens; {self._len + n} asked for")
        status = self.lib.llama_decode(self._ctx, self._batch)
        if status != 0:
            raise DraftlabError(f"llama_decode failed with status {status} ({n} tokens after {self._len})")

    def _logits(self, rows: int) -> torch.Tensor:
        """The last decode's output rows [rows, V] ([rows, V'] of a trimmed head), copied out of llama.cpp's
        buffer (rows of V, a trimmed head's logits first)."""
        pointer = self.lib.llama_get_logits(self._ctx)
        logits = np.ctypeslib.as_array(pointer, shape=(rows, self.vocab_size))[:, :self.out_rows]  # [rows, V']
        return torch.from_numpy(logits.copy())  # a copy: the buffer is llama.cpp's, reused by the next decode

    def __del__(self) -> None:
        free_native(self)


def check_head(model: LlamaCppModel, head_rows: torch.Tensor | None) -> None:
    """Refuse a head that is not the one asked for: a cut draft's rows need its trimmed GGUF, and a trimmed GGUF
    drafts only as a cut draft (its rows are not token ids)."""
    if head_rows is None and model.head_rows:
        raise DraftlabError(f"{model.path.name} holds a trimmed LM head of {model.head_rows} rows: it drafts only as "
                            "a cut draft (model:DIR of `draftlab design cut`, or model:NAME,head=N)")
    if head_rows is not None and model.head_rows != len(head_rows):
        raise DraftlabError(f"llama.cpp computes the LM head a GGUF holds: {model.path.name} holds "
                            f"{model.head_rows or 'all ' + str(model.vocab_size)} rows, not the {len(head_rows)} of "
                            "this cut draft (its trimmed GGUF: draftlab.backends.gguf_head)")


def free_native(owner) -> None:
    """Free what a llama.cpp backend holds natively (its batch, then its context), once; an object whose
    constructor failed half way holds some of them or none."""
    lib = getattr(owner, "lib", None)
    if lib is None:
        return
    if getattr(owner, "_batch", None) is not None:
        lib.llama_batch_free(owner._batch)
        owner._batch = None
    if getattr(owner, "_ctx", None):
        lib.llama_free(owner._ctx)
        owner._ctx = None


def dfs_order(parents: tuple[int, ...], children: tuple[tuple[int, ...], ...]) -> list[int]:
    """Block indices in depth-first order from the root (or roots: a draft scores forests), first children first:
    a topological order in which the first children's path comes right after the cache."""
    order, stack = [], [i for i in reversed(range(len(parents))) if parents[i] < 0]
    while stack:
        node = stack.pop()
        order.append(node)
        stack.extend(reversed(children[node]))
    return order


def leaves_below(children: tuple[tuple[int, ...], ...], order: list[int]) -> dict[int, list[int]]:
    """Each node's leaves (itself if a leaf), in depth-first order."""
    below: dict[int, list[int]] = {}
    for node in reversed(order):
        below[node] = [leaf for child in children[node] for leaf in below[child]] or [node]
    return below


def inverse(order: list[int]) -> list[int]:
    """Position of each block index in `order`."""
    where = [0] * len(order)
    for row, node in enumerate(order):
        where[node] = row
    return where
