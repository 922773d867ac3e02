"""What a drafter spec is, read from its first word: the one place besides `draftlab.registry` (which parses the whole
grammar) that reads a spec string, so that the study, the peers and the exports ask rather than compare strings
(tests/test_structure.py).
"""

from __future__ import annotations

PLAIN_DRAFTER = "none"  # the drafter spec of plain decoding (no draft); "ar" reads the same
ADAPT_PREFIXES = ("adapt/", "adapt:")  # a spec that wraps another for online adaptation


def is_plain_drafter(spec: str) -> bool:
    """Whether a drafter spec (or a study cell's drafter label) means plain decoding: no draft."""
    return spec in (PLAIN_DRAFTER, "ar", "")


def is_adapting(spec: str) -> bool:
    """Whether a drafter spec wraps another for online adaptation (`adapt[:OPTIONS]/SPEC`)."""
    return spec.startswith(ADAPT_PREFIXES)


def is_lookup(spec: str) -> bool:
    """Whether a drafter spec is prompt lookup (n-gram), which needs no model: what a peer's lookup runs."""
    return spec.partition(":")[0] == "ngram"


def learns_across_requests(spec: str) -> bool:
    """Whether a drafter spec is suffix decoding, whose cache holds the cell's earlier responses."""
    return spec.partition(":")[0] == "suffix"


def is_model_draft(spec: str) -> bool:
    """Whether a drafter spec is a stand-alone draft model or a layer draft (no tree, no staging, no cut head)."""
    return spec.partition(":")[0] in ("model", "layers") and ",head=" not in spec


def proposes_trees(spec: str) -> bool:
    """Whether a drafter spec proposes token trees (`tree:SHAPE:SPEC`, `merged:GUIDE/tree:...`)."""
    return spec.partition(":")[0] in ("tree", "merged")


def reads_target_layers(spec: str) -> bool:
    """Whether a drafter spec is an EAGLE-3 draft's chain, reading the inputs of target layers (on either engine)."""
    return spec.partition(":")[0] == "eagle3"


def serves_batched(spec: str) -> bool:
    """Whether a drafter spec's drafts serve several sequences at once (`Drafter.beside`) on either engine: plain
    decoding, n-gram lookup, suffix decoding's chains, draft models, EAGLE-3 chains and token trees of those
    (`tree:SHAPE:SPEC`; on llama.cpp each request's tree in its KV stream), what `draftlab serve` runs (feature
    drafts it serves on torch only)."""
    kind, _, rest = spec.partition(":")
    if kind == "tree":
        return serves_batched(rest.partition(":")[2])
    return (is_plain_drafter(spec) or is_lookup(spec) or (learns_across_requests(spec) and "tree" not in spec)
            or is_model_draft(spec) or reads_target_layers(spec))


def with_suffix_store(spec: str, directory: str) -> str:
    """Suffix decoding's spec keeping its cache in `directory` (its options kept)."""
    options = spec.partition(":")[2]
    return f"suffix:{options + ',' if options else ''}cache={directory}"
