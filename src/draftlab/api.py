"""The Python API: load once, then `generate` like Hugging Face.

    from draftlab import SpeculativeDecoder
    decoder = SpeculativeDecoder.from_names("smollm2-135m", drafter="ngram", k=4)
    out = decoder.generate("Write a haiku about caches.", max_new_tokens=64)
    print(out.text, out.stats.tokens_per_step)

Drafter spec strings: see `draftlab.registry` (the same grammar everywhere).
"""

from __future__ import annotations

from typing import Callable, Sequence

from draftlab.backends import Backend
from draftlab.compose import TargetSpec, given_target, load_target, one_sequence, target_drafter
from draftlab.files.datasets import Prompt
from draftlab.drafters.adapt import AdaptSettings
from draftlab.drafters.base import Drafter
from draftlab.engine import GenerationConfig, GenerationResult, PromptCache, SpeculativeEngine
from draftlab.errors import DraftlabError
from draftlab.measure import RunSettings
from draftlab.defaults import DEFAULT_BACKEND, DraftSettings
from draftlab.models import DEFAULT_TARGET, LoadedModel, ModelSpec, eos_ids, load_model  # noqa: F401 (API)
from draftlab.decoding.policy import DraftLengthPolicy, DynamicK, FixedK
from draftlab.registry import DraftPlan, adapt_spec, build_drafter, parse_drafter_spec, parse_layers  # noqa: F401 (API)
from draftlab.decoding.sampling import SamplingConfig


def make_policy(k: int, dynamic: bool = False) -> DraftLengthPolicy:
    """Fixed K, or HF-style dynamic K starting at k."""
    return DynamicK(k) if dynamic else FixedK(k)


def encode_prompt(tokenizer, text: str, chat: bool = True, history: Sequence[str] = ()) -> list[int]:
    """Token ids for a user prompt, through the chat template when the tokenizer has one, after the earlier turns
    of `history` (user and assistant in turn)."""
    if not text.strip():
        raise DraftlabError("the prompt is empty; give some text")
    if chat and getattr(tokenizer, "chat_template", None):
        turns = [*history, text]
        messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)]
        encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = encoded["input_ids"] if hasattr(encoded, "keys") else encoded
        return list(ids)
    return list(tokenizer("\n\n".join([*history, text]))["input_ids"])


def prompt_ids(tokenizer, prompt: Prompt) -> list[int]:
    """Token ids of a prompt of a prompt set (its earlier turns included)."""
    return encode_prompt(tokenizer, prompt.text, prompt.chat, prompt.history)


class SpeculativeDecoder:
    """A target, a drafter and a K policy, ready to `generate` text."""

    def __init__(
        self, target: LoadedModel, drafter: Drafter, policy: DraftLengthPolicy, target_backend: Backend,
        draft_model: LoadedModel | None = None, backend: str = DEFAULT_BACKEND,
        prompt_cache: PromptCache | None = None,
    ) -> None:
        """A decoder of built parts (`target_backend`: `draftlab.backends.make_backend` of the target); `from_names`
        builds them from names and spec strings (online adaptation is the spec `adapt[:OPTIONS]/SPEC`, or
        `from_names(adapt=)`). `prompt_cache`: shared by the decoders of one backend that reuse a prompt's prefill
        (`with_prompt_cache`); None: each generation prefills its prompt."""
        self.target = target
        self.drafter = drafter
        self.policy = policy
        self.draft_model = draft_model
        self.backend = backend
        # Decoders of one target may share its backend (one KV cache, one copy of fused
        # weights); they must then not generate concurrently.
        self.target_backend = target_backend
        self.engine = SpeculativeEngine(
            self.target_backend,
            drafter,
            policy,
            context_length=target.context_length,
            decode=None if target.tokenizer is None else  # random weights in a shape: token ids only
            (lambda ids: target.tokenizer.decode(ids, skip_special_tokens=True)),
            prompt_cache=prompt_cache,
        )
        self.prompt_cache = prompt_cache

    @classmethod
    def from_names(
        cls, target: str | LoadedModel = DEFAULT_TARGET, drafter: str = DraftSettings.drafter, k: int = DraftSettings.k,
        *, dynamic_k: bool = DraftSettings.dynamic_k, device: str = ModelSpec.device, dtype: str = ModelSpec.dtype,
        backend: str = DEFAULT_BACKEND, numerics: str = "auto", adapt: AdaptSettings | None = None,
    ) -> "SpeculativeDecoder":
        """Load the target (unless given) and build the drafter from its spec string.

        adapt: online adaptation of a feature draft or heads (as the spec `adapt[:OPTIONS]/SPEC`).
        backend: "auto" (draftlab's lean Llama forward where it applies, else
        transformers), "fast" (require the lean forward), "hf" (transformers) or llamacpp (the GGUF file as it
        is, in llama.cpp; drafts then run there too).
        numerics: "auto" (the exact route measured fastest on this host) or a route label for the fast backend;
        on llama.cpp "auto"/"exact" (kernels whose block rows equal single rows, repacked where that holds) or "repack"
        (llama.cpp's repacked weights for every type: where their kernels round rows apart, Q2_K or IQ4_NL or K-quants on a
        library without draftlab's Q4_K kernel, block rows of 4+ round differently). For the fast backend
        e.g. "fp32 exact-wm/4", or "fp32 linear" (faster on some hosts, but block rows then round differently
        from single rows: output equals plain decoding only up to rounding). Its dtype is loaded when dtype is auto.
        """
        policy = make_policy(k, dynamic_k)
        drafter = adapt_spec(drafter, adapt.label if adapt is not None else None)
        parts = load_target(TargetSpec(target, backend, device, dtype, numerics)) if isinstance(target, str) \
            else given_target(target, numerics, backend, dtype)
        built = target_drafter(drafter, parts)
        return cls(parts.loaded, built.drafter, policy, one_sequence(parts), built.model, parts.backend)

    def generate(
        self,
        prompt: str | Sequence[int],
        max_new_tokens: int = GenerationConfig.max_new_tokens,
        temperature: float = SamplingConfig.temperature,
        top_k: int = SamplingConfig.top_k,
        top_p: float = SamplingConfig.top_p,
        seed: int = GenerationConfig.seed,
        stop_strings: Sequence[str] = (),
        chat: bool = True,
        on_tokens: Callable[[list[int]], None] | None = None,
    ) -> GenerationResult:
        """Generate a continuation of `prompt` (text, or token ids used as they are)."""
        prompt_ids = encode_prompt(self.target.tokenizer, prompt, chat) if isinstance(prompt, str) else list(prompt)
        config = GenerationConfig(
            max_new_tokens=max_new_tokens,
            sampling=SamplingConfig(temperature, top_k, top_p),
            seed=seed,
            stop_strings=tuple(stop_strings),
            eos_token_ids=eos_ids(self.target),
        )
        return self.engine.generate(prompt_ids, config, on_tokens)

    def save_draft(self, out: str) -> str:
        """Write the draft as online adaptation left it (a draft directory of its format, which `model:DIR` loads);
        its path."""
        return str(self.drafter.save_learned(out))

    times_prefill = True  # the engine times its prefill apart (`draftlab.measure.Contender`)
    reuses_prefill = True  # with a prompt cache, a run after `prefill` starts from it

    @property
    def prefill_key(self) -> str:
        """Decoders that share a prompt cache share a prefill ('': none, each run prefills)."""
        return self.prompt_cache.name if self.prompt_cache is not None else ""

    def prefill(self, prompt_ids: list[int]) -> None:
        """Prefill the prompt into the prompt cache (`draftlab.measure.Contender`)."""
        self.engine.prefill(prompt_ids)

    def take_prefill(self, prompt_ids: list[int]) -> None:
        """Nothing: decoders of one key share the prompt cache that holds the prefill."""

    def run(self, prompt_ids: list[int], settings: RunSettings) -> GenerationResult:
        """One generation with the measurement loop's settings (`draftlab.measure.Contender`)."""
        return self.generate(prompt_ids, max_new_tokens=settings.max_new_tokens, temperature=settings.temperature,
                             top_k=settings.top_k, top_p=settings.top_p, seed=settings.seed)

    def forgetful(self) -> "SpeculativeDecoder":
        """The same decoder with a drafter that learns nothing across requests (warm-up runs)."""
        return self.with_drafter(self.drafter.forgetful())

    def with_policy(self, policy: DraftLengthPolicy) -> "SpeculativeDecoder":
        """The same target, backend and drafter with another K policy."""
        return SpeculativeDecoder(self.target, self.drafter, policy, self.target_backend, self.draft_model, self.backend,
                                  self.prompt_cache)

    def with_drafter(self, drafter: Drafter) -> "SpeculativeDecoder":
        """The same target, backend and K policy with another drafter (e.g. suffix decoding over another cache)."""
        return SpeculativeDecoder(self.target, drafter, self.policy, self.target_backend, self.draft_model, self.backend,
                                  self.prompt_cache)

    def with_prompt_cache(self, name: str) -> "SpeculativeDecoder":
        """The same decoder over a new prompt cache named `name`: the decoders derived from it share its backend's
        prefill of a prompt (`engine.PromptCache`); only they may use that backend from then on."""
        return SpeculativeDecoder(self.target, self.drafter, self.policy, self.target_backend, self.draft_model,
                                  self.backend, PromptCache(name))
