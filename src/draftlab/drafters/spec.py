"""Drafter spec strings: the grammar, and the plan a spec parses to (`draftlab.registry` builds its drafter).

Spec grammar:

  none | ar                   no draft: autoregressive decoding
  ngram | ngram:N | ngram:A-B prompt lookup with n-gram sizes 1..3, 1..N or A..B
  layers:SPEC[@DTYPE]         self-draft from target layers; SPEC is a comma list of
                              indices, ranges a-b and strided ranges a-b:s (0-3, 0-29:2, 0-3,26-29); on
                              llama.cpp a GGUF of those layers with the target's head, written once
                              (`backends.gguf_layers`), drafting in its own context
  model:NAME_OR_PATH[@DTYPE]  a separate draft model with the target's tokenizer, or a draft
                              directory (pruned draft, cut-vocabulary model draft, feature draft, EAGLE-3
                              draft or decoder heads: its record names the format). On llama.cpp a short
                              name drafts from its pure Q4_0 file (NAME@Q4_0_PURE, derived once: the type
                              llama.cpp's repacked kernels serve fastest); NAME@TYPE (capitals: @Q4_K_M,
                              @Q8_0) or a .gguf path drafts from that file. ...,window=N: the draft reads
                              only the prompt's last N tokens (its prefill costs N, not the whole prompt);
                              ...,head=N: its LM head keeps its N lowest token ids and the end-of-sequence
                              ids (a cut draft, `drafters.cut.ranked_cut`; on llama.cpp from a GGUF of
                              those rows, `backends.gguf_head`)
  ...@DTYPE                   (layer drafts, model drafts and cut drafts) run the draft in DTYPE (fp32, bf16,
                              fp16) instead of the target's: lossless whatever its rounding, since
                              only the target's scores decide what is kept. On CPUs without native
                              bf16 a single-token bf16 product still reads half the bytes, so a
                              bf16 draft can draft ~2x faster beside an fp32 target
  designed                    the designed draft shipped for the target (`drafters/shipped.py`), SHA256-checked
  eagle3                      the EAGLE-3 draft shipped for the target (`drafters/eagle3.py`), SHA256-checked
  tree:SHAPE:SPEC             a token tree grown by drafter SPEC (one with logits: layers, model,
                              designed, decoder heads); SHAPE is BxBx...[-N] (static) or dyn-T-N (dynamic), see
                              `draftlab.drafters.tree`; K is then the tree's depth
  staged:HELPER/SPEC          model draft SPEC (layers, model, a pruned draft) whose own drafting
                              is speculated by HELPER (ngram[:...] or layers:...), see
                              `draftlab.drafters.staged`
  suffix[:OPTIONS]            suffix decoding (vLLM's `suffix`, Arctic Inference's trees) over this request and earlier
                              responses; OPTIONS, comma-separated: depth=N, factor=F, offset=F, min_prob=P, tree|chain,
                              responses=N (held across requests; 0: none), cache=DIR (load, and append each
                              response); K is the most tokens a step proposes. See `draftlab.drafters.suffix`
  adapt[:OPTIONS]/SPEC        feature draft or decoder heads SPEC (designed, model:DIR of either, tree:...:designed,
                              merged:...) that keeps learning from the target's hidden states of what it decodes (online
                              adaptation, lossless); OPTIONS: lr=F, every=N, steps=N, window=N, batch=N, buffer=N,
                              warmup=N, noise=F, reread=0|1, seed=N. See `draftlab.drafters.adapt`
  merged:GUIDE/SPEC           n-gram lookup GUIDE (ngram[:...]) merged into the tree (or chain) of SPEC
                              (tree:SHAPE:... or a drafter with logits): the guide's continuation
                              is one branch, the draft's tokens the others, see `draftlab.drafters.tree`
"""

from __future__ import annotations

from dataclasses import dataclass

from draftlab.drafters.adapt import AdaptSettings
from draftlab.drafters.kinds import is_adapting
from draftlab.drafters.model_spec import split_dtype, split_options
from draftlab.drafters.suffix import SuffixOptions
from draftlab.drafters.tree import TreeShape
from draftlab.errors import DraftlabError

SPEC_HELP = ("none | ngram[:N|:A-B] | suffix[:depth=N,tree,responses=N,cache=DIR,...] | layers:0-3 (or 0,2,4 / "
             "0-29:2) | model:NAME_OR_PATH[,head=N][,window=N] | designed | eagle3 | tree:SHAPE:SPEC | "
             "staged:HELPER/SPEC | merged:GUIDE/SPEC | "
             "adapt[:lr=F,every=N,...]/SPEC; "
             "layer and model drafts take @fp32/@bf16/@fp16")


@dataclass(frozen=True)
class DraftPlan:
    """A parsed drafter spec string."""

    kind: str  # a key of DRAFTERS
    ngram: tuple[int, int] = (1, 3)  # (min_n, max_n)
    layers: tuple[int, ...] = ()
    model: str = ""
    tree: TreeShape | None = None  # kind "tree": the shape, grown by `inner`
    inner: "DraftPlan | None" = None  # kinds "tree", "staged" and "merged": the drafter they wrap
    helper: "DraftPlan | None" = None  # kinds "staged" and "merged": the cheaper drafter (guesses, or the guide)
    dtype: str = ""  # kinds "layers" and "model": the draft's dtype name; "" runs it in the target's
    window: int = 0  # kind "model": the prompt's last tokens the draft reads (0: all)
    head: int = 0  # kind "model": the LM head's rows, its lowest token ids (0: the whole head; `cut.ranked_cut`)
    suffix: SuffixOptions | None = None  # kind "suffix": its options
    adapt: AdaptSettings | None = None  # kind "adapt": how `inner` learns


def parse_drafter_spec(spec: str, num_layers: int | None = None) -> DraftPlan:
    """Parse a drafter spec string (see the module docstring)."""
    if is_adapting(spec):
        options, _, inner = spec[len("adapt") :].lstrip(":").partition("/")
        if inner:
            return DraftPlan("adapt", inner=parse_drafter_spec(inner, num_layers), adapt=AdaptSettings.parse(options))
    kind, _, arg = spec.partition(":")
    if kind in ("none", "ar") and not arg:
        return DraftPlan("none")
    if kind == "ngram":
        return DraftPlan("ngram", ngram=_parse_ngram(arg))
    if kind == "layers" and arg:
        arg, dtype = split_dtype(arg)
        return DraftPlan("layers", layers=tuple(parse_layers(arg, num_layers)), dtype=dtype)
    if kind == "model" and arg:
        arg, options = split_options(arg)
        arg, dtype = split_dtype(arg)
        return DraftPlan("model", model=arg, dtype=dtype, window=options.get("window", 0), head=options.get("head", 0))
    if kind == "suffix":
        return DraftPlan("suffix", suffix=SuffixOptions.parse(arg))
    if kind in ("designed", "eagle3") and not arg:
        return DraftPlan(kind)
    if kind == "tree" and ":" in arg:
        shape, _, inner = arg.partition(":")
        return DraftPlan("tree", tree=TreeShape.parse(shape), inner=parse_drafter_spec(inner, num_layers))
    if kind == "staged" and "/" in arg:
        helper, _, inner = arg.partition("/")
        return DraftPlan("staged", inner=parse_drafter_spec(inner, num_layers),
                         helper=parse_drafter_spec(helper, num_layers))
    if kind == "merged" and "/" in arg:
        guide, _, inner = arg.partition("/")
        return DraftPlan("merged", inner=parse_drafter_spec(inner, num_layers),
                         helper=parse_drafter_spec(guide, num_layers))
    raise DraftlabError(f"unknown drafter {spec!r}: use {SPEC_HELP}")


def _parse_ngram(arg: str) -> tuple[int, int]:
    """'' -> (1, 3); 'N' -> (1, N); 'A-B' -> (A, B); refused unless 1 <= A <= B (an inverted range is a typo, not a
    drafter that matches nothing)."""
    try:
        low, high = (1, 3) if not arg else tuple(int(x) for x in arg.split("-", 1)) if "-" in arg else (1, int(arg))
    except ValueError as exc:
        raise DraftlabError(f"bad n-gram size {arg!r}: use ngram:N or ngram:A-B with integers") from exc
    if not 1 <= low <= high:
        raise DraftlabError(f"bad n-gram sizes {arg!r}: ngram:A-B needs 1 <= A <= B (ngram:N means 1-N)")
    return (low, high)


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
