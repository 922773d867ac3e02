"""Online adaptation: drafts that keep learning from the target's own verification.

Online speculative decoding (Liu et al., 2023) distills the draft on the queries it actually serves. Every
verification step hands draftlab what the drafts that read the target's features are distilled on offline
(`draftlab.design.feature`, `draftlab.design.heads`): the target's final hidden states of the committed positions
(`Drafter.observe`), and with them the target's distribution there (its LM-head rows applied to them).
`AdaptingDrafter` wraps a drafter whose proposals come from a feature draft or decoder heads (`designed`, `model:DIR`
of either, or a tree grown by one, merged or not), keeps every position it sees (prompt and committed tokens) in a
bounded replay buffer, and every `every` new positions takes `steps` AdamW steps of the offline loss
(`feature_loss`, `heads_loss`) on a window of the newest positions and windows replayed from earlier requests. An
fp32 copy of the draft's own weights trains (`Learner`); the drafting copy (the target's dtype) takes its weights
after each update (with `reread=1` a feature draft also re-reads the request's real features with them).

Lossless: the target, its scores and the verifier are untouched; an update changes only what is proposed next,
and each proposal carries the draft probabilities of the weights that drew it. Its cost is in every figure: the
updates run inside `propose` and `finish`, so they count as drafting time.

Spec: `adapt[:OPTIONS]/SPEC`, OPTIONS comma-separated `lr=F, warmup=N, every=N, steps=N, window=N, batch=N,
buffer=N, noise=F, reread=0|1, seed=N` (`AdaptSettings`). `save(DIR)` writes the adapted draft as a draft directory
of its format (`model:DIR` loads it) whose record says what it learned from.
"""

from __future__ import annotations

import copy
import math
import time
from collections import deque
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Sequence

import torch

from draftlab.drafters.base import DraftAsk, propose_each
from draftlab.drafters.anchored import FeatureDrafter
from draftlab.drafters.feature import FeatureDraft, feature_loss, save_feature_draft
from draftlab.drafters.heads import HeadsDraft, HeadsDrafter, heads_loss, save_heads_draft
from draftlab.errors import DraftlabError
from draftlab.decoding.step import Proposal
from draftlab.decoding.verify import Verdict

WINDOW_HISTORY = 10  # requests in the record's "acceptance before/after" windows
HEADS_DECAY = 0.8  # head k's loss weight is HEADS_DECAY ** (k - 1), as `draftlab design heads` trains them


@dataclass(frozen=True)
class AdaptSettings:
    """How a draft learns while it decodes (the spec's options)."""

    lr: float = 1e-3  # AdamW's learning rate, after a linear warm-up
    warmup: int = 10  # optimizer steps over which the learning rate rises to lr (Adam's first steps are large)
    every: int = 32  # new positions (prompt and committed tokens) between updates
    steps: int = 1  # optimizer steps per update
    window: int = 64  # positions per training window
    batch: int = 2  # windows per step: the newest positions, then windows replayed from the buffer
    buffer: int = 8192  # positions the replay buffer holds (the oldest requests leave first)
    noise: float = 0.1  # input-feature noise, a fraction of the features' RMS (as offline)
    reread: int = 0  # 1: after an update a feature draft re-reads the request's features (its cache) with the new
    # weights; 0 (measured as accepting as much, for less): positions after the update use them
    regression_weight: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        finite = all(math.isfinite(v) for v in (self.lr, self.noise, self.regression_weight))
        if (not finite or self.lr <= 0 or self.noise < 0 or self.regression_weight < 0 or self.every < 1
                or self.steps < 1 or self.window < 3 or self.batch < 1 or self.buffer < 0 or self.warmup < 0
                or self.reread not in (0, 1)):
            raise DraftlabError("adapt options need finite numbers: lr > 0, noise >= 0, every >= 1, steps >= 1, "
                                "window >= 3, batch >= 1, buffer >= 0, warmup >= 0, reread 0 or 1")

    @classmethod
    def parse(cls, text: str) -> "AdaptSettings":
        """'lr=1e-4,every=32' -> settings; '' -> the defaults."""
        kinds = {f.name: f.type for f in fields(cls)}
        values: dict = {}
        for item in filter(None, text.split(",")):
            key, _, value = item.partition("=")
            if key not in kinds or not value:
                raise DraftlabError(f"unknown adapt option {item!r}: use " + ", ".join(f"{k}=..." for k in kinds))
            try:
                values[key] = float(value) if kinds[key] == "float" else int(value)
            except ValueError as exc:
                raise DraftlabError(f"adapt option {key} needs a number, got {value!r}") from exc
        return cls(**values)

    @property
    def label(self) -> str:
        """The options that differ from the defaults, as the spec writes them ('' for none)."""
        default = AdaptSettings()
        return ",".join(f"{f.name}={getattr(self, f.name):g}" for f in fields(self)
                        if getattr(self, f.name) != getattr(default, f.name))


class Learner:
    """The trainable side of an adapting draft: an fp32 copy of its own weights, AdamW and the replay buffer.

    Subclasses name the draft's trained module, the target tensors it shares, its loss and how it is saved."""

    def __init__(self, live, master, settings: AdaptSettings) -> None:
        self.live, self.master = live, master  # the drafting draft (the target's dtype) and its fp32 copy
        self.settings = settings
        params = list(self.module(master).parameters())
        for param in params:
            param.requires_grad_(True)
        self.module(master).train()
        self.optimizer = torch.optim.AdamW(params, lr=settings.lr, weight_decay=0.0)
        self.generator = torch.Generator().manual_seed(settings.seed)
        self.buffer: deque[tuple[torch.Tensor, torch.Tensor]] = deque()  # (features [n, D] fp32, tokens [n])
        self.scale = 0.0  # the features' RMS, from the first update
        self.steps = self.positions = 0
        self.train_s = 0.0

    @staticmethod
    def module(draft) -> torch.nn.Module:
        """The draft's own trained weights."""
        raise NotImplementedError

    def loss(self, features: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """The offline training loss on real features [B, T, D] and their tokens [B, T]."""
        raise NotImplementedError

    def frozen(self) -> list[torch.Tensor]:
        """The target's tensors the draft reads (shared, never copied)."""
        raise NotImplementedError

    def reread(self, source, features: torch.Tensor) -> None:
        """After an update with `reread`, let the drafting source re-read the request's features [n, D] (a no-op
        for drafts with no cache of them)."""

    def save(self, out: str | Path, target_name: str, made: dict) -> Path:
        """Write the trained draft (fp32) with this record as a draft directory."""
        raise NotImplementedError

    def remember(self, features: torch.Tensor, tokens: torch.Tensor) -> None:
        """Keep a finished request's positions for replay, within the buffer's bound."""
        self.positions += int(tokens.shape[0])
        if self.settings.buffer == 0:
            return
        self.buffer.append((features[-self.settings.buffer :], tokens[-self.settings.buffer :]))
        while sum(int(t.shape[0]) for _, t in self.buffer) > self.settings.buffer:
            self.buffer.popleft()

    def update(self, features: torch.Tensor, tokens: torch.Tensor) -> None:
        """`steps` optimizer steps on the newest window of this request (features [n, D], tokens [n]) and replayed
        windows; then the drafting draft takes the new weights."""
        start = time.perf_counter()
        if not self.scale:
            self.scale = float(features.pow(2).mean().sqrt())
        newest = (features[-self.settings.window :], tokens[-self.settings.window :])
        for _ in range(self.settings.steps):
            batch = [newest, *(self._replayed() for _ in range(self.settings.batch - 1))]
            self._step([w for w in batch if w is not None and w[1].shape[0] >= 3])
        self._sync()
        self.train_s += time.perf_counter() - start

    def _step(self, windows: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """One AdamW step on the mean loss of `windows`, those of one length in one batch [B, T]."""
        if not windows:
            return
        self.optimizer.zero_grad(set_to_none=True)
        for length in sorted({int(t.shape[0]) for _, t in windows}):
            group = [(f, t) for f, t in windows if t.shape[0] == length]
            features = torch.stack([f for f, _ in group])  # [B, T, D]
            tokens = torch.stack([t for _, t in group])  # [B, T]
            (self.loss(features, tokens) * len(group) / len(windows)).backward()
        torch.nn.utils.clip_grad_norm_(self.module(self.master).parameters(), 1.0)
        for param_group in self.optimizer.param_groups:
            param_group["lr"] = self.settings.lr * min(1.0, (self.steps + 1) / max(1, self.settings.warmup))
        self.optimizer.step()
        self.steps += 1

    def _replayed(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A random window of a random earlier request, or None when the buffer is empty."""
        if not self.buffer:
            return None
        features, tokens = self.buffer[int(torch.randint(len(self.buffer), (1,), generator=self.generator))]
        room = max(1, tokens.shape[0] - self.settings.window + 1)
        start = int(torch.randint(room, (1,), generator=self.generator))
        return features[start : start + self.settings.window], tokens[start : start + self.settings.window]

    def state(self) -> dict:
        """Everything learned so far (weights, optimizer, buffer, counters), for `torch.save`."""
        return {"weights": self.module(self.master).state_dict(), "optimizer": self.optimizer.state_dict(),
                "buffer": list(self.buffer), "scale": self.scale, "steps": self.steps, "positions": self.positions,
                "train_s": self.train_s, "generator": self.generator.get_state()}

    def load_state(self, state: dict) -> None:
        """Go on from a `state()`; the drafting draft takes its weights."""
        self.module(self.master).load_state_dict(state["weights"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.buffer = deque(state["buffer"])
        self.scale, self.steps, self.positions = state["scale"], state["steps"], state["positions"]
        self.train_s = state["train_s"]
        self.generator.set_state(state["generator"])
        self._sync()

    @torch.no_grad()
    def _sync(self) -> None:
        """Copy the trained fp32 weights into the drafting draft (its dtype)."""
        for live, trained in zip(self.module(self.live).parameters(), self.module(self.master).parameters()):
            live.copy_(trained)


class FeatureLearner(Learner):
    """A feature draft's layer (and fc), trained on EAGLE's two terms (`feature_loss`)."""

    def __init__(self, draft: FeatureDraft, settings: AdaptSettings) -> None:
        master = replace(draft, layer=copy.deepcopy(draft.layer).float(), head=draft.head.float(),
                         cos=draft.cos.float(), sin=draft.sin.float())
        super().__init__(draft, master, settings)

    @staticmethod
    def module(draft: FeatureDraft) -> torch.nn.Module:
        return draft.layer

    def loss(self, features: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return feature_loss(self.master, features, tokens, self.settings.noise * self.scale, self.generator,
                            self.settings.regression_weight)

    def frozen(self) -> list[torch.Tensor]:
        return [self.live.embed, self.live.head, self.live.vocab_map, self.live.cos, self.live.sin]

    def save(self, out: str | Path, target_name: str, made: dict) -> Path:
        return save_feature_draft(replace(self.master, made=made), out, target_name, dtype=torch.float32)

    def reread(self, source: FeatureDrafter, features: torch.Tensor) -> None:
        source.reanchor(features)


class HeadsLearner(Learner):
    """Decoder heads, trained on Medusa's loss (`heads_loss`, decay `HEADS_DECAY`); tokens are not needed."""

    def __init__(self, draft: HeadsDraft, settings: AdaptSettings) -> None:
        super().__init__(draft, replace(draft, heads=copy.deepcopy(draft.heads).float(), head=draft.head.float()),
                         settings)

    @staticmethod
    def module(draft: HeadsDraft) -> torch.nn.Module:
        return draft.heads

    def loss(self, features: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return heads_loss(self.master, features, HEADS_DECAY)

    def frozen(self) -> list[torch.Tensor]:
        return [self.live.head, self.live.vocab_map]

    def save(self, out: str | Path, target_name: str, made: dict) -> Path:
        return save_heads_draft(replace(self.master, made=made), out, target_name, dtype=torch.float32)


class AdaptingDrafter:
    """A drafter whose feature draft or heads learn online from the target's hidden states of every position it
    decodes."""

    reads_target_hidden = True
    target_taps = ()  # the feature drafts and heads it trains read the target's final hidden states

    def __init__(self, inner, source: FeatureDrafter | HeadsDrafter, settings: AdaptSettings, target_name: str,
                 base: str) -> None:
        """inner: the drafter (a feature drafter or heads, or a tree grown by one); source: the feature drafter or
        heads it proposes from (the registry knows which it built); base: what it was built from (the record names
        it)."""
        self.inner = inner
        self.source = source
        self.settings = settings
        self.target_name = target_name
        self.base = base
        learner = LEARNERS[source.learns_as]
        self.learner: Learner = learner(self.source.draft, settings)
        self._base = {k: v.clone() for k, v in learner.module(self.source.draft).state_dict().items()}  # as built
        self.name = f"adapt{':' + settings.label if settings.label else ''}/{inner.name}"
        self.requests: list[tuple[int, int]] = []  # (drafted, accepted) of each finished request
        self._begin_request()

    def _begin_request(self) -> None:
        self._features: list[torch.Tensor] = []  # real features [n, D] of this request's positions, in order
        self._pending = 0  # positions seen since the last update
        self._drafted = self._accepted = 0

    def begin(self, prompt_ids: Sequence[int]) -> None:
        """Start a request: the inner drafter too."""
        self.inner.begin(prompt_ids)
        self._begin_request()

    def observe(self, target_hidden: torch.Tensor) -> None:
        """Keep the target's hidden states [n, D] of the next committed positions; pass them on."""
        self.inner.observe(target_hidden)
        if target_hidden.shape[0]:
            self._features.append(target_hidden.detach().float().clone())  # a normal tensor, usable by autograd
            self._pending += int(target_hidden.shape[0])

    def propose(self, context, k, sampling, generator) -> Proposal:
        """Update the draft when `every` new positions arrived; then the inner drafter's proposal."""
        if self._pending >= self.settings.every:
            self._update(context)
        proposal = self.inner.propose(context, k, sampling, generator)
        self._drafted += len(proposal)
        return proposal

    def hear(self, proposal: Proposal, verdict: Verdict) -> None:
        """Count the step's accepted tokens; pass the verdict on."""
        self._accepted += verdict.num_accepted
        self.inner.hear(proposal, verdict)

    def finish(self, context: Sequence[int]) -> None:
        """Keep the request's positions for replay; count its acceptance."""
        self.inner.finish(context)
        if self._features:
            features = torch.cat(self._features)  # [n, D]
            self.learner.remember(features, torch.tensor(list(context[: features.shape[0]]), device=features.device))
        self.requests.append((self._drafted, self._accepted))
        self._features = []

    def confidence_stop(self):
        """The inner drafter's adaptive confidence stop, if any."""
        return self.inner.confidence_stop()

    def held(self) -> int:
        """Requests it has learned from."""
        return len(self.requests)

    def forgetful(self):
        """The inner drafter, drafting with the weights learned so far and learning nothing (warm-up runs)."""
        return self.inner

    def fork(self) -> "AdaptingDrafter":
        """An independent drafter that starts from the base weights (a sweep cell's own): the frozen target
        tensors are shared, the draft's own weights are copied."""
        inner, source = copy.deepcopy((self.inner, self.source), memo={id(t): t for t in self.learner.frozen()})
        self.learner.module(source.draft).load_state_dict(self._base)
        return AdaptingDrafter(inner, source, self.settings, self.target_name, self.base)

    def beside(self, seq: int) -> "AdaptingDrafter":
        """Refused: its weights learn from one sequence's hidden states at a time."""
        return self.inner.beside(seq)

    def propose_all(self, asks: Sequence[DraftAsk]) -> list[Proposal]:
        """Its one run's draft (it decodes one sequence at a time)."""
        return propose_each(asks)

    def lag(self, context: Sequence[int]) -> int:
        """Its inner draft's."""
        return self.inner.lag(context)

    def state(self) -> dict:
        """What this drafter learned, for `torch.save` (a sweep cell's checkpoint)."""
        return {"learner": self.learner.state(), "requests": list(self.requests)}

    def load_state(self, state: dict) -> None:
        """Go on from a `state()`."""
        self.learner.load_state(state["learner"])
        self.requests = [tuple(r) for r in state["requests"]]

    def _update(self, context: Sequence[int]) -> None:
        """Train on this request so far (with `reread`, a feature draft then re-reads its features)."""
        features = torch.cat(self._features)  # [n, D], n = len(context) - 1
        self._features = [features]
        self.learner.update(features, torch.tensor(list(context[: features.shape[0]]), device=features.device))
        if self.settings.reread:
            self.learner.reread(self.source, features)
        self._pending = 0

    def acceptance(self, last: int | None = None) -> float:
        """Accepted / drafted over the finished requests (the last `last` of them)."""
        window = self.requests[-last:] if last else self.requests
        drafted = sum(d for d, _ in window)
        return sum(a for _, a in window) / drafted if drafted else 0.0

    def record(self) -> dict:
        """What was learned, from what, for the saved draft's record."""
        first = self.requests[:WINDOW_HISTORY]
        drafted = sum(d for d, _ in first)
        return {"base": self.base, "settings": asdict(self.settings), "requests": len(self.requests),
                "positions": self.learner.positions, "steps": self.learner.steps,
                "train_s": round(self.learner.train_s, 2),
                "acceptance_first": round(sum(a for _, a in first) / drafted, 4) if drafted else 0.0,
                "acceptance_last": round(self.acceptance(WINDOW_HISTORY), 4), "window_requests": WINDOW_HISTORY}

    def learned(self) -> dict:
        """What was learned, from what (`record`)."""
        return self.record()

    def save_learned(self, out: str | Path) -> Path:
        """Write the adapted draft (fp32 weights) as a draft directory of its format, which `model:DIR` loads."""
        made = dict(self.source.draft.made)
        made["adapt"] = {**self.record(), **({"previous": made["adapt"]} if "adapt" in made else {})}
        return self.learner.save(out, self.target_name, made)


LEARNERS = {"feature": FeatureLearner, "heads": HeadsLearner}  # a source's `learns_as` -> what trains it
