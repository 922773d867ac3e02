"""llama-cpp-python's own high-level API as a peer: its plain `generate`, and its prompt-lookup decoding.

What a llama.cpp user runs without draftlab: `Llama(model_path=...)` with the library's default kernels
(repacked weights), and `Llama(..., draft_model=LlamaPromptLookupDecoding(num_pred_tokens=K))`, its speculative
decoding (which makes it compute logits for every row). Each instance's `prefill` evaluates a prompt but its
last token from an empty cache; its `generate` then reuses that prefix (the library's prefix match rolls its cache
back to it), as it reuses a repeated prompt for its users. Greedy runs of the lookup are compared with the plain `generate` of the
same library, as AsG is compared with HF's own `generate`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from draftlab.backends.gguf import llama_lib, threads
from draftlab.backends.llamacpp import MAX_CONTEXT
from draftlab.contenders.contract import ContenderSource, Method
from draftlab.engine import GenerationResult, check_room, tokens_result
from draftlab.errors import DraftlabError
from draftlab.decoding.sampling import SamplingConfig
from draftlab.drafters.kinds import is_lookup
from draftlab.models import gguf_path


class LlamaCppPeer:
    """One GGUF in llama-cpp-python's `Llama`, plain and with prompt lookup (two instances, loaded on first use)."""

    def __init__(self, path: Path, max_ngram: int = 2) -> None:
        """`max_ngram`: the lookup's longest n-gram (llama-cpp-python's default, 2)."""
        self.path = Path(path)
        self.max_ngram = max_ngram
        self._plain = None
        self._lookup = None

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

    def prefill(self, prompt_ids: Sequence[int], k: int = 0) -> None:
        """The instance's cache emptied and filled with the prompt but its last token (what `generate` then reuses,
        evaluating the last token as its first step)."""
        llm = self._llama(k)
        llm.reset()
        if len(prompt_ids) > 1:
            llm.eval(list(prompt_ids[:-1]))

    def contender(self, eos: tuple[int, ...], k: int = 0) -> "LlamaCppRun":
        """Its plain `generate` (k=0), or its prompt lookup at k, as a measurement contender."""
        return LlamaCppRun(self, eos, k)

    def _llama(self, k: int):
        """The plain instance, or the lookup instance set to draft k tokens."""
        llama_lib()  # draftlab's kernel settings before the library loads
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        if k < 0:
            raise DraftlabError(f"prompt lookup drafts k >= 1 tokens, got {k}")
        common = dict(model_path=str(self.path), n_ctx=MAX_CONTEXT, n_threads=threads(), n_threads_batch=threads(),
                      verbose=False)
        if k == 0:
            if self._plain is None:
                self._plain = Llama(**common)
            return self._plain
        if self._lookup is None:
            # With a draft model the library computes logits for every row, but sizes its score buffer from the
            # `logits_all` argument (n_batch rows when False): say True, or any prompt longer than 512 tokens fails.
            self._lookup = Llama(**common, logits_all=True,
                                 draft_model=LlamaPromptLookupDecoding(self.max_ngram, k))
        self._lookup.draft_model.num_pred_tokens = k
        return self._lookup


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

    @property
    def prefill_key(self) -> str:
        """The plain instance's and the lookup instance's caches are apart."""
        return "llama-cpp-python" + (" lookup" if self.k else "")

    def prefill(self, prompt_ids: list[int]) -> None:
        self.peer.prefill(prompt_ids, self.k)

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
