"""One registry: drafter spec strings -> drafters, draft directory formats -> loaders.

Used by the CLI, the Python API, the sweep, calibration, correlation and the
HF reference runs alike. The spec grammar and its parsing: `draftlab.drafters.spec`.

Adding a draft source is one file in `draftlab/drafters/` plus one entry in
`DRAFTERS` (a spec kind) or `DRAFT_FORMATS` (a draft directory format).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from draftlab.backends import make_backend
from draftlab.backends.gguf_layers import derive_layer_draft, layers_label
from draftlab.defaults import DEFAULT_BACKEND
from draftlab.drafters import cut, designed, eagle3, eagle3_checkpoint, feature, heads
from draftlab.drafters.anchored import AnchoredDrafter, FeatureDrafter
from draftlab.drafters.adapt import AdaptingDrafter
from draftlab.drafters.base import Drafter, NoDrafter
from draftlab.drafters.files import draft_format
from draftlab.drafters.kinds import is_adapting
from draftlab.drafters.layers import build_layer_draft
from draftlab.drafters.model_spec import gguf_draft
from draftlab.drafters.standalone import ModelDrafter, check_compatible
from draftlab.drafters.ngram import NGramDrafter
from draftlab.drafters.shipped import shipped_draft
from draftlab.drafters.staged import StagedDrafter
from draftlab.drafters.suffix import SuffixDrafter, tokenizer_fingerprint
from draftlab.drafters.tree import TreeDrafter, TreeShape, TreeSource
from draftlab.errors import DraftlabError
from draftlab.files import assets
from draftlab.drafters.spec import SPEC_HELP, DraftPlan, parse_drafter_spec, parse_layers  # noqa: F401 (API)
from draftlab.models import (DTYPES, LoadedModel, ModelSpec, dtype_name, dtype_suffix, gguf_path, load_model,
                             split_weight_type)


@dataclass
class BuiltDraft:
    """A drafter and, when it runs a causal LM of its own, that model (HF assisted generation needs it); and what
    the wrappers built around it need, known here because the registry built it: the drafter whose logits can grow
    a tree, the model drafter a staged draft speculates, the feature draft or heads online adaptation trains."""

    drafter: Drafter
    model: LoadedModel | None = None
    tree_source: TreeSource | None = None
    model_drafter: ModelDrafter | None = None
    learnable: FeatureDrafter | heads.HeadsDrafter | None = None
    weights: int = 0  # parameters of a draft that is no causal LM (EAGLE-3, feature, heads), target parts it reads too

    @property
    def parameters(self) -> int:
        """The draft's parameters, the target's embeddings and head rows it reads included (as a layer draft's
        count includes them); 0: a draft without weights (n-gram, suffix)."""
        return self.model.num_parameters() if self.model is not None else self.weights


def _draft_dtype(plan: DraftPlan, target: LoadedModel) -> torch.dtype:
    """The dtype a layer or model draft runs in: its spec's, else the target's."""
    return DTYPES[plan.dtype] if plan.dtype else target.dtype


def build_drafter(plan: DraftPlan | str, target: LoadedModel, backend: str = DEFAULT_BACKEND) -> BuiltDraft:
    """The drafter for a spec (string or parsed) on `target`, with its draft model when it has one."""
    if isinstance(plan, str):
        plan = parse_drafter_spec(plan, target.model.config.num_hidden_layers)
    return DRAFTERS[plan.kind](plan, target, backend)


def _needs_torch_target(target: LoadedModel, what: str) -> None:
    """Refuse drafts built from the target's own weights when the target runs in llama.cpp."""
    if not target.engine.torch_drafts:
        raise DraftlabError(f"{what} is built from the target's torch weights; on --backend llamacpp use ngram, "
                            "suffix, layers:LIST, model:NAME_OR_GGUF, or tree/staged/merged drafts of those (or "
                            "--backend fast)")


def _needs_tapped_target(target: LoadedModel, what: str) -> None:
    """Refuse drafts reading the inputs of target layers (EAGLE-3) on an engine that hands none over."""
    if not target.engine.tapped_drafts:
        raise DraftlabError(f"{what} reads the inputs of the target's layers, which {target.engine} does not hand "
                            "over; use --backend fast or llamacpp")


def _build_none(plan: DraftPlan, target: LoadedModel, backend: str) -> BuiltDraft:
    return BuiltDraft(NoDrafter())


def _build_ngram(plan: DraftPlan, target: LoadedModel, backend: str) -> BuiltDraft:
    return BuiltDraft(NGramDrafter(max_n=plan.ngram[1], min_n=plan.ngram[0]))


def _build_suffix(plan: DraftPlan, target: LoadedModel, backend: str) -> BuiltDraft:
    tokenizer_id = tokenizer_fingerprint(target.tokenizer) if plan.suffix.cache else ""
    return BuiltDraft(SuffixDrafter(plan.suffix, tokenizer_id=tokenizer_id))


def _build_layers(plan: DraftPlan, target: LoadedModel, backend: str) -> BuiltDraft:
    if target.engine.runs_gguf:  # the target's layers as a GGUF of their own (`backends.gguf_layers`)
        if plan.dtype:
            raise DraftlabError(f"a layer draft on llama.cpp runs the target's tensors in their weight type: drop "
                                f"@{plan.dtype}")
        path = derive_layer_draft(gguf_path(target.source), plan.layers, assets.cache_dir())
        draft = load_model(ModelSpec(str(path)), backend=target.engine.backend, repack=True)
        draft.name = f"layers:{layers_label(plan.layers)}"
        return _model_draft(draft, target.engine.backend)
    return _model_draft(build_layer_draft(target, plan.layers, _draft_dtype(plan, target)), backend)


def _build_model(plan: DraftPlan, target: LoadedModel, backend: str) -> BuiltDraft:
    fmt = draft_format(plan.model)
    if plan.head:  # a cut draft of the lowest token ids
        return _built_cut(plan, cut.ranked_cut(plan.model, plan.head, target), target, backend)
    if fmt is not None:
        if fmt not in DRAFT_FORMATS:
            raise DraftlabError(f"{plan.model} holds a draft of unknown format {fmt!r}; known: {sorted(DRAFT_FORMATS)}")
        if fmt == eagle3.FORMAT:
            _needs_tapped_target(target, f"the EAGLE-3 draft in {plan.model}")
        elif fmt != cut.FORMAT:  # a cut draft is a stand-alone model: llama.cpp runs it from a trimmed GGUF
            _needs_torch_target(target, f"the {fmt} draft in {plan.model}")
        return DRAFT_FORMATS[fmt](plan, target, backend)
    if eagle3_checkpoint.is_checkpoint(plan.model):  # the engines' EAGLE-3 checkpoint (vLLM, SGLang, SpecForge)
        _needs_tapped_target(target, f"the EAGLE-3 checkpoint in {plan.model}")
        return _load_eagle3(plan, target, backend)
    if target.engine.runs_gguf:  # a GGUF draft in its own context of the target's engine
        # Repacked weights: a draft's rounding never decides what is committed, and they draft faster.
        draft = load_model(ModelSpec(gguf_draft(plan.model), dtype=plan.dtype or "auto"),
                           backend=target.engine.backend, repack=True)
        check_compatible(target, draft)
        return _model_draft(draft, target.engine.backend, plan.window)
    draft = load_model(ModelSpec(plan.model, device=str(target.device), dtype=dtype_name(_draft_dtype(plan, target))))
    check_compatible(target, draft)
    draft.name += dtype_suffix(draft.dtype, target.dtype)
    return _model_draft(draft, backend, plan.window)


def _build_designed(plan: DraftPlan, target: LoadedModel, backend: str) -> BuiltDraft:
    """The draft shipped for the target under this kind's name (`designed`, `eagle3`)."""
    if plan.kind == "eagle3":
        _needs_tapped_target(target, "the eagle3 draft")
    else:
        _needs_torch_target(target, f"the {plan.kind} draft")
    model = split_weight_type(target.name)[0]  # the draft shipped for a model serves it in every weight type
    built = _build_model(DraftPlan("model", model=str(shipped_draft(model, plan.kind))), target, backend)
    built.drafter.name = plan.kind
    return built


def _build_tree(plan: DraftPlan, target: LoadedModel, backend: str) -> BuiltDraft:
    inner = build_drafter(plan.inner, target, backend)
    if inner.tree_source is None:
        raise DraftlabError(f"drafter {inner.drafter.name} has no logits to grow a tree from; "
                            "use a model, layer or designed draft inside tree:SHAPE:SPEC")
    return BuiltDraft(TreeDrafter(inner.tree_source, plan.tree, target.vocab_size), inner.model,
                      learnable=inner.learnable, weights=inner.weights)


def _build_staged(plan: DraftPlan, target: LoadedModel, backend: str) -> BuiltDraft:
    inner = build_drafter(plan.inner, target, backend)
    if inner.model_drafter is None:
        raise DraftlabError(f"staged drafting speculates a model draft's own drafting; {inner.drafter.name} is not "
                            "one: use layers:..., model:... or a pruned draft after the '/'")
    helper = build_drafter(plan.helper, target, backend)
    if helper.drafter.reads_target_hidden or plan.helper.kind == "staged":
        raise DraftlabError(f"the helper of a staged draft must be n-gram lookup or a layer/model draft, "
                            f"got {helper.drafter.name}")
    return BuiltDraft(StagedDrafter(inner.model_drafter, helper.drafter, helper.model_drafter), inner.model)


def _build_merged(plan: DraftPlan, target: LoadedModel, backend: str) -> BuiltDraft:
    if plan.helper.kind != "ngram":
        raise DraftlabError(f"the guide of a merged tree looks its tokens up: use ngram[:...] before the '/', "
                            f"got {plan.helper.kind}")
    inner_plan = plan.inner if plan.inner.kind == "tree" else DraftPlan("tree", tree=TreeShape((1,)), inner=plan.inner)
    source = build_drafter(inner_plan.inner, target, backend)
    if source.tree_source is None:
        raise DraftlabError(f"drafter {source.drafter.name} has no logits to grow a tree from; "
                            "use a model, layer or designed draft inside tree:SHAPE:SPEC")
    guide = NGramDrafter(max_n=plan.helper.ngram[1], min_n=plan.helper.ngram[0])
    return BuiltDraft(TreeDrafter(source.tree_source, inner_plan.tree, target.vocab_size, guide), source.model,
                      learnable=source.learnable, weights=source.weights)


def _build_adapt(plan: DraftPlan, target: LoadedModel, backend: str) -> BuiltDraft:
    inner = build_drafter(plan.inner, target, backend)
    if inner.learnable is None:
        raise DraftlabError(f"adapt learns feature drafts and decoder heads (designed, model:DIR of either, or a "
                            f"tree of one); {inner.drafter.name} is neither")
    return BuiltDraft(AdaptingDrafter(inner.drafter, inner.learnable, plan.adapt, target.name,
                                      base=inner.drafter.name), inner.model, weights=inner.weights)


def can_adapt(spec: str) -> bool:
    """Whether online adaptation applies to a spec: a feature draft or decoder heads, or a tree (merged or not) grown
    by one."""
    plan = parse_drafter_spec(spec)
    while plan.kind in ("tree", "merged"):
        plan = plan.inner
    return plan.kind == "designed" or (plan.kind == "model" and draft_format(plan.model) in (feature.FORMAT,
                                                                                              heads.FORMAT))


def with_adapting(specs: tuple[str, ...], options: str | None) -> tuple[str, ...]:
    """Each spec, followed by its adapting twin where online adaptation applies (`options` None: specs as given)."""
    if options is None:
        return specs
    return tuple(x for spec in specs for x in ([spec, adapt_spec(spec, options)] if can_adapt(spec) else [spec]))


def adapt_spec(spec: str, options: str | None) -> str:
    """`spec` wrapped for online adaptation with these options (None: `spec` as it is)."""
    if options is None or is_adapting(spec):
        return spec
    return f"adapt{':' + options if options else ''}/{spec}"


def _model_draft(draft: LoadedModel, backend: str, window: int = 0) -> BuiltDraft:
    drafter = ModelDrafter(make_backend(draft.model, draft.device, backend, batch_invariant=False),
                           name=draft.name + (f",window={window}" if window else ""), window=window)
    return _model_built(drafter, draft)


def _model_built(drafter: ModelDrafter, draft: LoadedModel) -> BuiltDraft:
    """A model drafter: it grows trees and can be a staged draft's inner draft."""
    return BuiltDraft(drafter, draft, tree_source=drafter, model_drafter=drafter)


def _load_designed(plan: DraftPlan, target: LoadedModel, backend: str) -> BuiltDraft:
    _refuse_dtype(plan, "a designed draft (it shares the target's embeddings)")
    draft = designed.load_draft(plan.model, target)
    drafter = ModelDrafter(make_backend(draft.model.model, target.device, backend, batch_invariant=False),
                           draft.model.name,
                           draft.vocab_map, target.vocab_size)
    return _model_built(drafter, draft.model)


def _load_cut(plan: DraftPlan, target: LoadedModel, backend: str) -> BuiltDraft:
    return _built_cut(plan, cut.read_cut_draft(plan.model, target), target, backend)


def _built_cut(plan: DraftPlan, record: cut.CutDraft, target: LoadedModel, backend: str) -> BuiltDraft:
    if target.engine.runs_gguf:
        _refuse_dtype(plan, "a cut draft on llama.cpp")
        draft, backend = cut.load_cut_gguf(record, target), target.engine.backend
    else:
        draft = cut.load_cut_model(record, target, _draft_dtype(plan, target))
    check_compatible(target, draft)
    model_backend = make_backend(draft.model, draft.device, backend, batch_invariant=False, head_rows=record.vocab_map)
    name = (f"{draft.name}/v{len(record.vocab_map)}{dtype_suffix(draft.dtype, target.dtype)}"
            + (f",window={plan.window}" if plan.window else ""))
    drafter = ModelDrafter(model_backend, name, record.vocab_map, target.vocab_size, window=plan.window)
    return _model_built(drafter, draft)


def _load_feature(plan: DraftPlan, target: LoadedModel, backend: str) -> BuiltDraft:
    _refuse_dtype(plan, "a feature draft")
    path = plan.model
    draft = feature.load_feature_draft(path, target)
    drafter = FeatureDrafter(draft, name=f"feature:{path}")
    return BuiltDraft(drafter, tree_source=drafter, learnable=drafter,
                      weights=_weights(draft.layer, draft.embed, draft.head))


def _load_eagle3(plan: DraftPlan, target: LoadedModel, backend: str) -> BuiltDraft:
    """An EAGLE-3 draft: draftlab's draft directory, or the engines' checkpoint."""
    _refuse_dtype(plan, "an EAGLE-3 draft")
    path = plan.model
    read = eagle3_checkpoint.read_checkpoint if eagle3_checkpoint.is_checkpoint(path) else eagle3.load_eagle3_draft
    draft = read(path, target)
    drafter = AnchoredDrafter(draft, name=f"eagle3:{path}")
    return BuiltDraft(drafter, tree_source=drafter, weights=_weights(draft.layer, draft.embed, draft.head))


def _load_heads(plan: DraftPlan, target: LoadedModel, backend: str) -> BuiltDraft:
    _refuse_dtype(plan, "decoder heads")
    path = plan.model
    draft = heads.load_heads_draft(path, target)
    drafter = heads.HeadsDrafter(draft, name=f"heads:{path}")
    return BuiltDraft(drafter, tree_source=drafter, learnable=drafter, weights=_weights(draft.heads, draft.head))


def _weights(module: torch.nn.Module, *tensors: torch.Tensor) -> int:
    """Parameters of a draft's own module and of the tensors (target parts) it reads."""
    return sum(p.numel() for p in module.parameters()) + sum(t.numel() for t in tensors)


def _refuse_dtype(plan: DraftPlan, what: str) -> None:
    if plan.dtype:
        raise DraftlabError(f"{plan.model} holds {what}, which runs in its stored dtype: drop @{plan.dtype}")


DRAFTERS: dict[str, Callable[[DraftPlan, LoadedModel, str], BuiltDraft]] = {
    "none": _build_none,
    "ngram": _build_ngram,
    "suffix": _build_suffix,
    "layers": _build_layers,
    "model": _build_model,
    "designed": _build_designed,
    "eagle3": _build_designed,
    "tree": _build_tree,
    "staged": _build_staged,
    "merged": _build_merged,
    "adapt": _build_adapt,
}
DRAFT_FORMATS: dict[str, Callable[[DraftPlan, LoadedModel, str], BuiltDraft]] = {
    designed.FORMAT: _load_designed,
    cut.FORMAT: _load_cut,
    feature.FORMAT: _load_feature,
    eagle3.FORMAT: _load_eagle3,
    heads.FORMAT: _load_heads,
}
