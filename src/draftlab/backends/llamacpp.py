"""llama.cpp as a backend of one sequence: GGUF targets and drafts scored by llama.cpp's own kernels, quantized as
they are (`draftlab generate`, a study's cell, a draft model).

A `LlamaCppBackend` is sequence 0 of a `LlamaCppSequences` of its own, the one llama.cpp backend that `draftlab
serve` runs its requests in flight on too (`draftlab.backends.llamacpp_sequences`): one `llama_context` per backend,
target and draft sharing nothing but the tokenizer. Its one unified stream verifies token trees with a sequence per
leaf (`draftlab.backends.llamacpp_trees`).
"""

from __future__ import annotations

import torch

from draftlab.backends.gguf import LlamaCppModel
from draftlab.backends.llamacpp_sequences import LlamaCppSequences, SequenceView
from draftlab.errors import DraftlabError


class LlamaCppBackend(SequenceView):
    """A GGUF model in llama.cpp with its own context and KV cache, one sequence."""

    def __init__(self, model: LlamaCppModel, device: str = "cpu", batch_invariant: bool | None = None,
                 head_rows: torch.Tensor | None = None) -> None:
        """`batch_invariant` is accepted for the registry's sake: rows are exact whenever the library's kernels are
        (`LlamaCppModel.kernels`). `head_rows` [V'] (a cut draft): the model's GGUF holds a head of exactly those
        rows (`draftlab.backends.gguf_head`), and logits are [n, V']."""
        if str(device) != "cpu":
            raise DraftlabError(f"the llamacpp backend runs on the CPU here, not {device}")
        check_head(model, head_rows)
        super().__init__(LlamaCppSequences(model), 0)


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
