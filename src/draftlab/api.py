"""The Python API: load once, then `generate` like Hugging Face.

    from draftlab import SpeculativeDecoder
    decoder = SpeculativeDecoder.from_names("smollm2-135m", drafter="ngram", k=4)
    out = decoder.generate("Write a haiku about caches.", max_new_tokens=64)
    print(out.text, out.stats.tokens_per_step)

Drafter spec strings (also used by the CLI):
  none | ar                  no draft: autoregressive decoding
  ngram | ngram:N | ngram:A-B prompt lookup with n-gram sizes 1..3, 1..N or A..B
  layers:SPEC                self-draft from target layers; SPEC is a comma list
                             of indices, ranges a-b and strided ranges a-b:s,
                             e.g. layers:0-3, layers:0-29:2, layers:0-3,26-29
  model:NAME_OR_PATH         a separate draft model with the target's tokenizer, or a
                             draft directory made by `draftlab design prune/distill`
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from draftlab.backend import Backend
from draftlab.fast_llama import make_backend
from draftlab.drafters import (
    Drafter,
    ModelDrafter,
    NGramDrafter,
    NoDrafter,
    build_layer_draft,
    check_compatible,
)
from draftlab.design.prune import is_draft_dir, load_draft
from draftlab.feature_draft import FeatureDrafter, is_feature_draft, load_feature_draft
from draftlab.engine import GenerationConfig, GenerationResult, SpeculativeEngine
from draftlab.errors import DraftlabError
from draftlab.models import LoadedModel, ModelSpec, load_model
from draftlab.policy import DraftLengthPolicy, DynamicK, FixedK
from draftlab.sampling import SamplingConfig


@dataclass(frozen=True)
class DraftPlan:
    """A parsed drafter spec string."""

    kind: str  # none | ngram | layers | model
    ngram: tuple[int, int] = (1, 3)  # (min_n, max_n)
    layers: tuple[int, ...] = ()
    model: str = ""


def parse_drafter_spec(spec: str, num_layers: int | None = None) -> DraftPlan:
    """Parse a drafter spec string (see the module docstring)."""
    kind, _, arg = spec.partition(":")
    if kind in ("none", "ar") and not arg:
        return DraftPlan("none")
    if kind == "ngram":
        return DraftPlan("ngram", ngram=_parse_ngram(arg))
    if kind == "layers" and arg:
        return DraftPlan("layers", layers=tuple(parse_layers(arg, num_layers)))
    if kind == "model" and arg:
        return DraftPlan("model", model=arg)
    raise DraftlabError(
        f"unknown drafter {spec!r}: use none, ngram[:N|:A-B], layers:0-3 (or 0,2,4 / 0-29:2), model:NAME_OR_PATH"
    )


def _parse_ngram(arg: str) -> tuple[int, int]:
    try:
        if not arg:
            return (1, 3)
        if "-" in arg:
            low, high = (int(x) for x in arg.split("-", 1))
            return (low, high)
        return (1, int(arg))
    except ValueError as exc:
        raise DraftlabError(f"bad n-gram size {arg!r}: use ngram:N or ngram:A-B with integers") from exc


def parse_layers(text: str, num_layers: int | None = None) -> list[int]:
    """'0-3,26-29' -> [0,1,2,3,26,27,28,29]; 'a-b:s' steps by s; negatives count from the end."""
    layers: list[int] = []
    try:
        for item in text.split(","):
            span, _, step = item.partition(":")
            low, sep, high = span.partition("-") if not span.startswith("-") else (span, "", "")
            first = int(low)
            last = int(high) if sep else first
            layers.extend(range(first, last + 1, int(step) if step else 1))
    except ValueError as exc:
        raise DraftlabError(f"bad layer list {text!r}: use indices, ranges a-b or strided ranges a-b:s") from exc
    if num_layers is not None:
        layers = [i + num_layers if i < 0 else i for i in layers]
    return layers


def build_drafter(plan: DraftPlan, target: LoadedModel, backend: str = "auto") -> tuple[Drafter, LoadedModel | None]:
    """A drafter for `plan`; also the draft model when there is one (HF assisted generation needs it)."""
    if plan.kind == "none":
        return NoDrafter(), None
    if plan.kind == "ngram":
        return NGramDrafter(max_n=plan.ngram[1], min_n=plan.ngram[0]), None
    if plan.kind == "layers":
        draft = build_layer_draft(target, plan.layers)
    elif is_feature_draft(plan.model):
        return FeatureDrafter(load_feature_draft(plan.model, target), name=f"feature:{plan.model}"), None
    elif is_draft_dir(plan.model):
        designed = load_draft(plan.model, target)
        drafter = ModelDrafter(make_backend(designed.model.model, target.device, backend), designed.model.name,
                               designed.vocab_map, target.vocab_size)
        return drafter, designed.model
    else:
        draft = load_model(ModelSpec(plan.model, device=str(target.device), dtype=_dtype_name(target)))
        check_compatible(target, draft)
    return ModelDrafter(make_backend(draft.model, draft.device, backend), name=draft.name), draft


def _dtype_name(model: LoadedModel) -> str:
    return str(model.dtype).removeprefix("torch.")


def make_policy(k: int, dynamic: bool = False) -> DraftLengthPolicy:
    """Fixed K, or HF-style dynamic K starting at k."""
    return DynamicK(k) if dynamic else FixedK(k)


def encode_prompt(tokenizer, text: str, chat: bool = True) -> list[int]:
    """Token ids for a user prompt, through the chat template when the tokenizer has one."""
    if not text.strip():
        raise DraftlabError("the prompt is empty; give some text")
    if chat and getattr(tokenizer, "chat_template", None):
        encoded = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        ids = encoded["input_ids"] if hasattr(encoded, "keys") else encoded
        return list(ids)
    return list(tokenizer(text)["input_ids"])


def eos_ids(model: LoadedModel) -> tuple[int, ...]:
    """End-of-sequence ids from the generation config and the tokenizer."""
    ids = model.model.generation_config.eos_token_id
    ids = list(ids) if isinstance(ids, (list, tuple)) else ([ids] if ids is not None else [])
    if model.tokenizer.eos_token_id is not None:
        ids.append(model.tokenizer.eos_token_id)
    return tuple(sorted(set(ids)))


class SpeculativeDecoder:
    """A target, a drafter and a K policy, ready to `generate` text."""

    def __init__(
        self, target: LoadedModel, drafter: Drafter, policy: DraftLengthPolicy,
        draft_model: LoadedModel | None = None, backend: str = "auto", target_backend: Backend | None = None,
    ) -> None:
        self.target = target
        self.drafter = drafter
        self.policy = policy
        self.draft_model = draft_model
        self.backend = backend
        # Decoders of one target may share its backend (one KV cache, one copy of fused
        # weights); they must then not generate concurrently.
        self.target_backend = target_backend or make_backend(target.model, target.device, backend)
        self.engine = SpeculativeEngine(
            self.target_backend,
            drafter,
            policy,
            context_length=target.context_length,
            decode=lambda ids: target.tokenizer.decode(ids, skip_special_tokens=True),
        )

    @classmethod
    def from_names(
        cls, target: str | LoadedModel = "smollm2-135m", drafter: str = "ngram", k: int = 4,
        *, dynamic_k: bool = False, device: str = "cpu", dtype: str = "auto", backend: str = "auto",
    ) -> "SpeculativeDecoder":
        """Load the target (unless given) and build the drafter from its spec string.

        backend: "auto" (draftlab's lean Llama forward where it applies, else
        transformers), "fast" (require the lean forward) or "hf" (transformers).
        """
        policy = make_policy(k, dynamic_k)
        loaded = target if isinstance(target, LoadedModel) else load_model(target, device=device, dtype=dtype)
        plan = parse_drafter_spec(drafter, loaded.model.config.num_hidden_layers)
        draft, draft_model = build_drafter(plan, loaded, backend)
        return cls(loaded, draft, policy, draft_model, backend)

    def generate(
        self,
        prompt: str | Sequence[int],
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int = 0,
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

    def with_policy(self, policy: DraftLengthPolicy) -> "SpeculativeDecoder":
        """The same target, backend and drafter with another K policy."""
        return SpeculativeDecoder(self.target, self.drafter, policy, self.draft_model, self.backend, self.target_backend)

    def autoregressive(self) -> "SpeculativeDecoder":
        """A decoder for the same target and backend with no drafter: the baseline."""
        return SpeculativeDecoder(self.target, NoDrafter(), FixedK(1), backend=self.backend,
                                  target_backend=self.target_backend)
