"""llama-cpp-python's own high-level API as a peer: its plain `generate`, and its prompt-lookup decoding.

What a llama.cpp user runs without draftlab: `Llama(model_path=...)` with the library's default kernels
(repacked weights), and its speculative decoding, `draft_model=LlamaPromptLookupDecoding(num_pred_tokens=K)`. Both
run on one `Llama` instance: one model, one cache, so a prompt is prefilled once for both (one prefill key). Its
`prefill` evaluates a prompt but its last token, asking for the last row's logits only, as plain decoding does; a
`generate` then reuses that prefix (the library's prefix match rolls its cache back to it), as it reuses a repeated
prompt for its users. Plain decoding runs with no draft model and logits for the last row; the lookup with its
draft model and logits for every row of a block (what the library sets up for a draft model). Which rows return
logits changes what is copied out, not the cache: a prompt's keys and values are stored before a last layer picks
its output rows. Greedy runs of the lookup are compared with the plain `generate` of the same library, as AsG is
compared with HF's own `generate`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from draftlab.backends.gguf import llama_lib, threads
from draftlab.backends.llamacpp_sequences import MAX_CONTEXT
from draftlab.contenders.contract import ContenderSource, Method
from draftlab.engine import GenerationResult, check_room, tokens_result
from draftlab.errors import DraftlabError
from draftlab.decoding.sampling import SamplingConfig
from draftlab.drafters.kinds import is_lookup
from draftlab.models import gguf_path


class LlamaCppPeer:
    """One GGUF in one llama-cpp-python `Llama` (loaded on first use), set per call to decode plainly or with prompt
    lookup."""

    def __init__(self, path: Path, max_ngram: int = 2) -> None:
        """`max_ngram`: the lookup's longest n-gram (llama-cpp-python's default, 2)."""
        self.path = Path(path)
        self.max_ngram = max_ngram
        self._llm = None

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, eos: Sequence[int], sampling: SamplingConfig,
                 seed: int, k: int = 0) -> list[int]:
        """New tokens: plain `generate` (k=0) or with prompt lookup drafting k tokens a step. Timed only through
        `contender` in the measurement loop."""
        llm = self._llama(k)
        llm.set_seed(seed)
        tokens: list[int] = []
        for token in llm.generate(list(prompt_ids), temp=sampling.temperature, top_k=sampling.top_k,
                                  top_p=sampling.top_p, min_p=0.0, repeat_penalty=1.0, reset=True):
            tokens.append(int(token))
            if token in eos or len(tokens) >= max_new_tokens:
                break
        return tokens

    def prefill(self, prompt_ids: Sequence[int]) -> None:
        """The cache emptied and filled with the prompt but its last token, as plain decoding evaluates it (what
        `generate` then reuses, evaluating the last token as its first step, plainly or with the lookup)."""
        llm = self._llama(0)
        llm.reset()
        if len(prompt_ids) > 1:
            llm.eval(list(prompt_ids[:-1]))

    def contender(self, eos: tuple[int, ...], k: int = 0) -> "LlamaCppRun":
        """Its plain `generate` (k=0), or its prompt lookup at k, as a measurement contender."""
        return LlamaCppRun(self, eos, k)

    def _llama(self, k: int):
        """The instance, set to decode plainly (k=0) or with the lookup drafting k tokens."""
        if k < 0:
            raise DraftlabError(f"prompt lookup drafts k >= 1 tokens, got {k}")
        llm = self._loaded()
        llm.draft_model = self._lookup(k) if k else None
        # Which rows return logits: every row of a block for the lookup, the last for plain decoding. The library
        # fixes this at construction (`logits_all`, forced True by a draft model) and reads it at every `eval`;
        # it has no public setter, so its attribute is set here (llama-cpp-python 0.3.36, pinned).
        llm._logits_all = bool(k)
        return llm

    def _loaded(self):
        """The one `Llama` of the file, with room for logits of every row (the lookup's; a prompt longer than
        `n_batch` fails with less)."""
        if self._llm is None:
            llama_lib()  # draftlab's kernel settings before the library loads
            from llama_cpp import Llama

            self._llm = Llama(model_path=str(self.path), n_ctx=MAX_CONTEXT, n_threads=threads(),
                              n_threads_batch=threads(), logits_all=True, verbose=False)
        return self._llm

    def _lookup(self, k: int):
        """llama-cpp-python's prompt-lookup draft model, drafting k tokens a step."""
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        return LlamaPromptLookupDecoding(self.max_ngram, k)


@dataclass(frozen=True)
class LlamaCppRun:
    """llama-cpp-python's `generate` (k=0) or its prompt lookup at k as a measurement contender
    (`draftlab.measure.Contender`): it times only the whole call; after `prefill`, that call is the decode (and
    the prompt's last token)."""

    peer: LlamaCppPeer
    eos: tuple[int, ...]
    k: int = 0
    times_prefill = False
    reuses_prefill = True

    prefill_key = "llama-cpp-python"  # plain decoding and the lookup share one instance, so one cache

    def prefill(self, prompt_ids: list[int]) -> None:
        self.peer.prefill(prompt_ids)

    def take_prefill(self, prompt_ids: list[int]) -> None:
        """Nothing: the instance that holds the prefill is its own."""

    def run(self, prompt_ids: list[int], settings) -> GenerationResult:
        """One generation with the loop's settings (a prompt longer than the context refused as draftlab's engine
        refuses it)."""
        check_room(len(prompt_ids), settings.max_new_tokens, MAX_CONTEXT)
        tokens = self.peer.generate(prompt_ids, settings.max_new_tokens, self.eos, settings.sampling, settings.seed,
                                    self.k)
        return tokens_result(prompt_ids, tokens)

    def forgetful(self) -> "LlamaCppRun":
        """Itself: it learns nothing across runs (a prefix it reuses is the same prompt's)."""
        return self


def _peer(source: ContenderSource) -> LlamaCppPeer:
    """llama-cpp-python on the target's GGUF, loaded once per target."""
    return source.shared("llama-cpp-python", lambda: LlamaCppPeer(gguf_path(source.target.source)))


def _plain(source: ContenderSource, cell, _companions: tuple) -> LlamaCppRun:
    return _peer(source).contender(source.eos, 0)


def _lookup(source: ContenderSource, cell, _companions: tuple) -> LlamaCppRun:
    return _peer(source).contender(source.eos, cell.k)


LLAMA = Method("llama", "llama-cpp-python", 2, "llama-cpp-python", plain=True, reference="ar", times_prefill=False,
               peer=True, gguf_only=True, swept=False, build=_plain)
LCP = Method("lcp", "llama-cpp-python's prompt lookup", 4, "llama-cpp-python", plain=False, reference="llama",
             times_prefill=False, peer=True, gguf_only=True, takes=is_lookup, build=_lookup)
METHODS = (LLAMA, LCP)
