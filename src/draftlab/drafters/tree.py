"""Token trees: any drafter with logits proposes several branches, verified by the target in one pass.

When the draft's first guess is wrong its second is often right; a tree
drafts both and the target's single pass (tree attention mask, `draftlab.decoding.step`)
scores every branch. `TreeDrafter` wraps a `TreeSource` (a drafter that can
give its logits after any node of a tree: `ModelDrafter`, `FeatureDrafter`,
`HeadsDrafter`)
and grows the tree level by level; K is the tree's depth.

Shapes (`TreeShape.parse`):

  B1xB2x...   static: every node at depth d gets B_d children (deeper levels
              continue as chains), e.g. `3x2x1`: 3 first tokens, 2
              continuations of each, then chains.
  dyn-T-N     dynamic (EAGLE-2's expansion): at each depth the T nodes of the
              newest level with the highest cumulative draft probability get
              T children each, until the tree holds N nodes.

A static shape may end in `-N` too (`3x2x1-10`): the node budget, filled in
order of cumulative draft probability. Any shape may end in `@P`: the
confidence stop; a node whose cumulative draft probability is below P is
drafted but not expanded (`1@0.3` is a chain that stops once the drafted
sequence's likelihood falls below 0.3, up to K tokens). `@auto` lets the
threshold move with what the target accepts: the tree exposes it as a knob
(`confidence_stop`) and the engine's policy (`draftlab.decoding.policy.AdaptiveConfidence`)
moves it, down after a step whose deepest drafted path was accepted whole, up
after a rejection.

Lossless in both modes. Greedy verification follows the target's argmax
through any tree, so children are the draft's top tokens. Under sampling a
node's children are drawn from the draft's distribution *without
replacement* and each carries the distribution it was drawn from (the draft's,
with the earlier siblings removed): the verifier's multi-candidate rejection
sampling over those rows is recursive rejection sampling without replacement,
which keeps the target's distribution exactly. The number of children of a
node is decided before they are drawn (from the shape, the budget and the
cumulative probability of the node and its ancestors), never from the drawn
children's own values; pruning after drawing would bias the output.

Merged trees (`merged:GUIDE/SPEC`): a guide drafter that looks tokens up (n-gram
prompt lookup) puts its chain into the tree as the first child at every depth
of its path, and the source's children at those nodes are drawn without the
guide's token. The guide's nodes are one-hot drafts; the source's siblings are
drawn from the source's distribution with the guide's token removed, which is
the next step of the same recursive rejection sampling, so the tree stays
lossless. When the context repeats itself the n-gram continuation is often
right where the draft model is not, and where it finds nothing the tree is
the source's alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from draftlab.backends.numerics import scatter_vocab
from draftlab.drafters.base import PerRequest
from draftlab.errors import DraftlabError
from draftlab.decoding.sampling import SamplingConfig, logits_to_probs
from draftlab.decoding.policy import AdaptiveConfidence, ConfidenceStop
from draftlab.decoding.step import MAX_DRAFT_TOKENS, ROOT, Proposal

SHAPE_HELP = ("BxBx... (static branching per depth, optional -N node budget) or dyn-T-N (dynamic, EAGLE-2), "
              "either optionally with @P (confidence stop)")


@dataclass(frozen=True)
class TreeShape:
    """How a tree grows: static branching per depth, or dynamic expansion of the most probable nodes."""

    branching: tuple[int, ...] = (2,)  # children per node at depth 0, 1, ... (then 1: chains); static shapes
    expand: int = 0  # dynamic shapes: nodes expanded per level, each with `expand` children; 0: static
    nodes: int = 0  # node budget; 0: no budget
    min_prob: float = 0.0  # confidence stop: nodes less likely than this (cumulatively) are not expanded
    adaptive: bool = False  # the stop moves with acceptance, starting at min_prob

    def __post_init__(self) -> None:
        if self.expand < 0 or self.nodes < 0 or not self.branching or min(self.branching) < 1:
            raise DraftlabError(f"bad tree shape {self}: branching >= 1, expand and nodes >= 0")
        if not 0.0 <= self.min_prob < 1.0:
            raise DraftlabError(f"a tree's confidence stop must be in [0, 1), got {self.min_prob}")
        if self.expand and not self.nodes:
            raise DraftlabError("a dynamic tree needs a node budget (dyn-T-N)")
        width = self.expand * self.expand if self.expand else math.prod(self.branching)
        if max(width, self.nodes) > MAX_DRAFT_TOKENS:
            raise DraftlabError(f"tree shape {self}: {max(width, self.nodes)} nodes in a level or budget, past the "
                                f"{MAX_DRAFT_TOKENS} drafted tokens a step may score")

    @classmethod
    def parse(cls, text: str) -> "TreeShape":
        """'3x2x1', '3x2x1-10', 'dyn-2-8', each optionally with '@P' (see the module docstring)."""
        try:
            text, _, stop = text.partition("@")
            adaptive = stop == "auto"
            min_prob = AdaptiveConfidence.START if adaptive else float(stop) if stop else 0.0
            if text.startswith("dyn-"):
                expand, nodes = (int(x) for x in text.removeprefix("dyn-").split("-"))
                return cls((expand,), expand, nodes, min_prob, adaptive)
            shape, _, budget = text.partition("-")
            return cls(tuple(int(b) for b in shape.split("x")), 0, int(budget) if budget else 0, min_prob, adaptive)
        except ValueError as exc:
            raise DraftlabError(f"bad tree shape {text!r}: use {SHAPE_HELP}") from exc

    def __str__(self) -> str:
        if self.expand:
            text = f"dyn-{self.expand}-{self.nodes}"
        else:
            shape = "x".join(map(str, self.branching))
            text = f"{shape}-{self.nodes}" if self.nodes else shape
        if self.adaptive:
            return f"{text}@auto"
        return f"{text}@{self.min_prob:g}" if self.min_prob else text

    def children(self, depth: int) -> int:
        """Children of each expanded node at this depth (0: the root)."""
        return self.expand or (self.branching[depth] if depth < len(self.branching) else 1)


class TreeSource(Protocol):
    """A drafter that can give its logits after any node of a draft tree."""

    name: str
    reads_target_hidden: bool
    target_taps: tuple[int, ...]
    vocab_map: torch.Tensor | None  # [V'] target id of each draft logit row; None: the target's vocabulary
    max_depth: int | None  # the deepest tree it can draft (decoder heads: one level per head); None: any

    def begin(self, prompt_ids: Sequence[int]) -> None: ...

    def observe(self, target_hidden: torch.Tensor) -> None: ...

    def beside(self, seq: int) -> "TreeSource": ...

    def finish(self, context: Sequence[int]) -> None: ...

    def root_logits(self, context: Sequence[int]) -> torch.Tensor | None:
        """Draft logits [V'] for the token after `context`; None when there is nothing to draft from."""
        ...

    def tree_logits(self, tokens: list[int], parents: tuple[int, ...], rows: list[int]) -> torch.Tensor:
        """Draft logits [len(rows), V'] after tree nodes `rows`; tokens (target ids) and parents: the tree so far."""
        ...


@dataclass
class _Node:
    token: int  # target token id
    parent: int  # index into the node list, ROOT for the first level
    logprob: float  # cumulative draft log-probability from the root
    probs: torch.Tensor | None  # [V'] the distribution this token was drawn from (sampling); None: greedy
    guided: bool = False  # a guide's token: a one-hot draft in the target's vocabulary (sampling)


class ChainGuide(Protocol):
    """A drafter that looks its chain up (n-gram prompt lookup): no probabilities, no hidden states."""

    name: str

    def begin(self, prompt_ids: Sequence[int]) -> None: ...

    def propose(self, context, k, sampling, generator) -> Proposal: ...


class TreeDrafter(PerRequest):
    """Wraps a `TreeSource`: proposes a tree of the given shape whose depth is K (with a guide's chain merged in)."""

    def __init__(self, source: TreeSource, shape: TreeShape, target_vocab_size: int,
                 guide: ChainGuide | None = None) -> None:
        self.source, self.shape, self.target_vocab_size, self.guide = source, shape, target_vocab_size, guide
        self.name = f"tree:{shape}:{source.name}"
        if guide is not None:
            self.name = f"merged:{guide.name}/{self.name}"
        self.reads_target_hidden = source.reads_target_hidden
        self.target_taps = source.target_taps
        self.stop = ConfidenceStop(shape.min_prob) if shape.adaptive else None  # moved by `AdaptiveConfidence`
        self._draft_rows = _draft_rows(source.vocab_map)

    def begin(self, prompt_ids: Sequence[int]) -> None:
        """Start the source (and the guide) on a new sequence."""
        self.source.begin(prompt_ids)
        if self.guide is not None:
            self.guide.begin(prompt_ids)

    @property
    def min_prob(self) -> float:
        """The confidence stop in force for the next proposal."""
        return self.stop.value if self.stop is not None else self.shape.min_prob

    def observe(self, target_hidden: torch.Tensor) -> None:
        """Pass the target's hidden states on to the source."""
        self.source.observe(target_hidden)

    def beside(self, seq: int) -> "TreeDrafter":
        """The same tree for one more sequence in flight (`draftlab serve` on torch): its source's and guide's own
        (a one-line error where the source decodes one sequence at a time)."""
        guide = self.guide.beside(seq) if self.guide is not None else None
        return TreeDrafter(self.source.beside(seq), self.shape, self.target_vocab_size, guide)

    def finish(self, context: Sequence[int]) -> None:
        """The generation ended: the source lets its state go."""
        self.source.finish(context)

    @torch.inference_mode()
    def propose(self, context, k, sampling: SamplingConfig, generator) -> Proposal:
        """A tree of depth <= k grown from the source's logits."""
        return self._grow(context, k, sampling, generator)

    def confidence_stop(self) -> ConfidenceStop | None:
        """The adaptive confidence stop (`@auto`) the engine's policy moves; None for a fixed one."""
        return self.stop

    def _grow(self, context, k, sampling, generator) -> Proposal:
        if self.source.max_depth is not None:
            k = min(k, self.source.max_depth)
        logits = self.source.root_logits(context)  # [V']
        if logits is None or k < 1:
            return Proposal([])
        guide = self._guide_chain(context, k, sampling, generator)
        nodes: list[_Node] = []
        frontier, frontier_logits = [ROOT], logits[None]  # [1, V']
        for depth in range(k):
            new = self._grow_level(nodes, frontier, frontier_logits, depth, guide, sampling, generator)
            frontier = self._to_expand(nodes, new)
            if not frontier or depth + 1 == k:
                break
            tokens, parents = [n.token for n in nodes], tuple(n.parent for n in nodes)
            frontier_logits = self.source.tree_logits(tokens, parents, frontier)  # [f, V']
        return self._proposal(nodes)

    def _guide_chain(self, context, k, sampling, generator) -> list[int]:
        """The guide's chain (target ids, up to k), or [] without a guide."""
        if self.guide is None:
            return []
        return list(self.guide.propose(context, k, sampling, generator).tokens[:k])

    def _grow_level(self, nodes, frontier, frontier_logits, depth, guide, sampling, generator) -> list[int]:
        """Draw the children of each frontier node (most probable parents first, within the budget); the
        guide's node of the previous level gets the guide's next token first."""
        new: list[int] = []
        for index, logits in zip(frontier, frontier_logits):
            room = self._room(nodes)
            if room <= 0:
                break
            base = nodes[index].logprob if index != ROOT else 0.0
            exclude = None
            if depth < len(guide) and self._on_guide_path(nodes, index, depth):
                exclude = self._add_guide_node(nodes, guide[depth], index, base, logits, sampling)
                new.append(len(nodes) - 1)
                room -= 1
            count = min(self.shape.children(depth), room)
            for row, logprob, probs in draw_children(logits.float(), count, sampling, generator, exclude):
                nodes.append(_Node(self._target_id(row), index, base + logprob, probs))
                new.append(len(nodes) - 1)
        return new

    @staticmethod
    def _on_guide_path(nodes: list[_Node], index: int, depth: int) -> bool:
        """Whether `index` is the guide's node at depth-1 (the root at depth 0)."""
        return index == ROOT if depth == 0 else index != ROOT and nodes[index].guided

    def _add_guide_node(self, nodes, token, parent, base, logits, sampling) -> int | None:
        """Append the guide's token under `parent` (its draft log-probability from the parent's logits [V']);
        returns its draft row (to keep out of the source's children), or None when the source lacks it."""
        row = self._draft_rows.get(token) if self._draft_rows is not None else token
        if row is not None and row >= logits.shape[-1]:
            row = None
        floor = math.log(1e-30)
        logprob = float(torch.log_softmax(logits.float(), dim=-1)[row]) if row is not None else floor
        one_hot = None
        if not sampling.greedy:
            one_hot = torch.zeros(self._proposal_width(logits.shape[-1]))  # [V]
            one_hot[token] = 1.0
        nodes.append(_Node(token, parent, base + max(logprob, floor), one_hot, guided=True))
        return row

    def _proposal_width(self, draft_width: int) -> int:
        """The width of proposal rows: the target's vocabulary for cut-vocabulary sources, else the source's."""
        return draft_width if self.source.vocab_map is None else self.target_vocab_size

    def _target_id(self, row: int) -> int:
        """The target token id of draft logit row `row`."""
        vocab_map = self.source.vocab_map
        return row if vocab_map is None else int(vocab_map[row])

    def _room(self, nodes: list[_Node]) -> int:
        return self.shape.nodes - len(nodes) if self.shape.nodes else 1 << 30

    def _to_expand(self, nodes: list[_Node], level: list[int]) -> list[int]:
        """The newest level's nodes to expand, most probable first: those above the confidence stop
        (dynamic shapes keep the best `expand` of them)."""
        floor = math.log(self.min_prob) if self.min_prob else -math.inf
        ranked = sorted((i for i in level if nodes[i].logprob >= floor and not nodes[i].guided),
                        key=lambda i: (-nodes[i].logprob, i))
        ranked = ranked[: self.shape.expand] if self.shape.expand else ranked
        return [i for i in level if nodes[i].guided] + ranked  # the guide's path is always followed

    def _proposal(self, nodes: list[_Node]) -> Proposal:
        """Nodes in topological order as a proposal in target token ids."""
        vocab_map = self.source.vocab_map
        tokens = [n.token for n in nodes]
        parents = tuple(n.parent for n in nodes)
        if not nodes or nodes[0].probs is None:  # greedy: one-hot drafts
            return Proposal(tokens, parents)
        rows = [n.probs if vocab_map is None or n.guided else scatter_vocab(n.probs, vocab_map, self.target_vocab_size)
                for n in nodes]
        return Proposal(tokens, parents, torch.stack(rows))  # draft_probs [n, V]


def _draft_rows(vocab_map: torch.Tensor | None) -> dict[int, int] | None:
    """Target id -> draft logit row for a cut vocabulary; None when the source uses the target's."""
    if vocab_map is None:
        return None
    return {int(token): row for row, token in enumerate(vocab_map.tolist())}


def draw_children(logits: torch.Tensor, count: int, sampling: SamplingConfig, generator: torch.Generator | None,
                  exclude: int | None = None) -> list[tuple[int, float, torch.Tensor | None]]:
    """Up to `count` distinct tokens from draft logits [V']: (token, log-probability, drawn-from row or None).

    Greedy: the top tokens. Sampling: drawn one after another without
    replacement; each row is the distribution its token was drawn from.
    `exclude`: a row already drafted as an earlier sibling (a guide's token).
    """
    if count <= 0:
        return []
    if sampling.greedy:
        logprobs = torch.log_softmax(logits, dim=-1)  # [V']
        if exclude is not None:
            logprobs = logprobs.clone()
            logprobs[exclude] = -math.inf
        top = torch.topk(logprobs, min(count, logprobs.shape[-1] - (exclude is not None)))
        return [(int(t), float(lp), None) for t, lp in zip(top.indices, top.values)]
    probs = logits_to_probs(logits, sampling)  # [V']
    drawn: list[tuple[int, float, torch.Tensor | None]] = []
    remaining = probs
    if exclude is not None:
        remaining = probs.clone()
        remaining[exclude] = 0.0
    for _ in range(count):
        total = float(remaining.sum())
        if total <= 0:
            break
        row = remaining / total  # [V'] what this child is drawn from
        token = int(torch.multinomial(row, 1, generator=generator))
        drawn.append((token, math.log(max(float(probs[token]), 1e-30)), row))
        remaining = remaining.clone()
        remaining[token] = 0.0
    return drawn
