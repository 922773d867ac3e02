"""The weight type as a dimension of the study: per model run in more than one GGUF type (`--weight-types`), each
type's file size, fastest plain decoding, fastest configuration, and how many of its plain outputs equal the shipped
type's.

A target `llamacpp:NAME@BF16` is NAME's GGUF written as BF16 by llama.cpp's quantizer: another rounding of the same
model, so its outputs may differ from the shipped type's; the study says how often, beside the speed.
`benchmarks/weight_types.py` adds the log-likelihood of the shipped type's outputs under each type.
"""

from __future__ import annotations

from dataclasses import dataclass

from draftlab.models import split_weight_type
from draftlab.study.run.cells import LLAMACPP_TARGET
from draftlab.study.answer.report import ALL, CellSummary
from draftlab.contenders.methods import AR, PLAIN, method_of
from draftlab.errors import DraftlabError
from draftlab.models import gguf_path

SHIPPED = "shipped"


@dataclass(frozen=True)
class WeightTypeRow:
    """One weight type of one model over the study's prompts (greedy, temperature 0)."""

    model: str
    weight_type: str  # 'shipped' or the derived type's name
    megabytes: float | None  # the GGUF's size (None: not on this machine)
    plain_tokens_per_s: float  # its fastest plain decoding (any engine)
    best: str  # its fastest configuration, in words
    best_tokens_per_s: float
    identical_to_shipped: int | None  # prompts whose plain output equals the shipped type's plain output
    prompts: int


def weight_type_rows(summaries: list[CellSummary], rows: list[dict], size_of=None) -> list[WeightTypeRow]:
    """Per model with more than one weight type among the llama.cpp targets. `size_of(source)`: the GGUF's bytes
    (None: sizes left out)."""
    targets: dict[str, dict[str, str]] = {}
    for s in summaries:
        if s.dataset == ALL and s.temperature == 0 and s.target.startswith(LLAMACPP_TARGET):
            base, kind = split_weight_type(s.target.removeprefix(LLAMACPP_TARGET))
            targets.setdefault(base, {})[kind or SHIPPED] = s.target
    out = []
    for model, types in sorted(targets.items()):
        if len(types) < 2 or SHIPPED not in types:
            continue
        shipped = _plain_outputs(rows, types[SHIPPED])
        for kind, target in sorted(types.items(), key=lambda item: item[0] != SHIPPED):
            cells = [s for s in summaries if s.target == target and s.dataset == ALL and s.temperature == 0
                     and s.complete and s.tokens_per_s > 0]
            plain = max((s.tokens_per_s for s in cells if method_of(s.method).plain), default=0.0)
            best = max(cells, key=lambda s: s.tokens_per_s)
            own = _plain_outputs(rows, target)
            same = sum(own[p] == shipped.get(p) for p in own) if shipped else None
            size = size_of(target.removeprefix(LLAMACPP_TARGET)) if size_of else None
            out.append(WeightTypeRow(model, kind, size / 1e6 if size else None, plain, _name(best),
                                     best.tokens_per_s, same, len(own)))
    return out


def _plain_outputs(rows: list[dict], target: str) -> dict[str, str]:
    """prompt -> output hash of draftlab's plain decoding of `target` (greedy)."""
    return {r["prompt_id"]: r["output_sha"] for r in rows
            if r["target"] == target and r["method"] == AR.name and r["temperature"] == 0}


def _name(s: CellSummary) -> str:
    if method_of(s.method).plain:
        return f"plain decoding ({s.drafter if s.method == PLAIN.name else s.method})"
    exact = " (lossless only up to rounding)" if s.rounding else ""
    return f"{s.method} {s.drafter}" + (f" K={s.k}" if s.k else "") + exact


def weight_type_sentences(table: list[WeightTypeRow]) -> list[str]:
    """Per model: the fastest type against the shipped type's plain decoding, its file size, and its outputs."""
    sentences = []
    for model in dict.fromkeys(row.model for row in table):
        types = [row for row in table if row.model == model]
        shipped = types[0]
        best = max(types, key=lambda row: row.best_tokens_per_s)
        size = (f"; its file is {best.megabytes:.0f} MB against {shipped.megabytes:.0f} MB shipped"
                if best.megabytes and shipped.megabytes else "")
        same = ("" if best.weight_type == SHIPPED or best.identical_to_shipped is None else
                f"; its plain decoding equals the shipped type's on {best.identical_to_shipped}/{best.prompts} prompts "
                "(another rounding of the same model)")
        sentences.append(f"Weight type for {model}: the fastest is {best.weight_type}, {best.best}, "
                         f"{best.best_tokens_per_s:.1f} tok/s, {best.best_tokens_per_s / shipped.plain_tokens_per_s:.2f}x "
                         f"the shipped type's plain decoding ({shipped.plain_tokens_per_s:.1f} tok/s){size}{same}.")
    return sentences


def format_weight_types(table: list[WeightTypeRow]) -> str:
    """The table for people ('' when no model ran in more than one type)."""
    if not table:
        return ""
    lines = [f"{'model':<22}{'type':<10}{'MB':>7}{'plain tok/s':>13}{'best tok/s':>12}{'= shipped':>11}  best"]
    for row in table:
        size = f"{row.megabytes:.0f}" if row.megabytes else "-"
        same = f"{row.identical_to_shipped}/{row.prompts}" if row.identical_to_shipped is not None else "-"
        lines.append(f"{row.model:<22}{row.weight_type:<10}{size:>7}{row.plain_tokens_per_s:>13.1f}"
                     f"{row.best_tokens_per_s:>12.1f}{same:>11}  {row.best}")
    return "\n".join(lines)


def file_bytes(source: str) -> int | None:
    """A GGUF's size where it is on this machine (a derived type is derived on demand, from its cached source)."""
    try:
        return gguf_path(source).stat().st_size
    except (DraftlabError, OSError):
        return None
