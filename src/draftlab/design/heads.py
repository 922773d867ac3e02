"""Training decoder heads (Medusa-style) on the target's hidden states.

The heads read the same data as a feature draft (`feature.py`): the target's
final hidden states and greedy next tokens over its own text, computed once
and cached (`features.pt`), so a feature draft's directory can lend its
features and no target pass is needed. Head k at position t learns the
target's distribution at position t + k (the token t + 1 + k), as a soft
label: cross-entropy against softmax(head_rows @ f_{t+k}), summed over heads
with Medusa's decay (head k weighted `decay ** (k - 1)`). Training runs in the
shared loop (training.py): budget, checkpoints, resume, held-out agreement.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from draftlab.design.feature import FeatureSettings, load_or_make_features
from draftlab.design.training import LoopSettings, ModuleStudent, train, train_rows
from draftlab.drafters.heads import HeadsDraft, heads_loss, save_heads_draft
from draftlab.errors import DraftlabError
from draftlab.models import LoadedModel

LOG = "train_log.jsonl"


@dataclass(frozen=True)
class HeadsSettings:
    """Data shape, loss and the training loop's settings."""

    budget_s: float = 600.0
    seq_len: int = 256
    batch_size: int = 8
    lr: float = 1e-3
    warmup_steps: int = 20
    weight_decay: float = 0.0
    checkpoint_every_s: float = 60.0
    seed: int = 0
    max_steps: int | None = None  # a step budget instead of the wall-clock one: the same run on every host
    decay: float = 0.8  # head k's loss weight is decay ** (k - 1) (Medusa's)
    held_out_fraction: float = 0.03
    feature_dtype: str = "auto"  # the target pass when features are computed: auto, bf16 or fp32

    def __post_init__(self) -> None:
        if self.budget_s <= 0 or self.checkpoint_every_s <= 0:
            raise DraftlabError("budget and checkpoint interval must be positive")
        if self.seq_len < 3 or self.batch_size < 1:
            raise DraftlabError("seq_len >= 3 and batch_size >= 1 are required")
        if not 0.0 < self.decay <= 1.0:
            raise DraftlabError(f"the heads' loss decay must be in (0, 1], got {self.decay}")

    def features(self) -> FeatureSettings:
        """The settings the shared feature cache is made with."""
        return FeatureSettings(seq_len=self.seq_len, feature_dtype=self.feature_dtype)


class HeadsStudent(ModuleStudent):
    """Decoder heads under training, as the training loop's `Student`."""

    def module(self) -> torch.nn.Module:
        return self.draft.heads

    def loss(self, rows: list[int]) -> torch.Tensor:
        return heads_loss(self.draft, self.data["features"][rows].float(), self.settings.decay)

    @torch.no_grad()
    def agreements(self) -> list[float]:
        """Held-out top-1 agreement of each head with the target's greedy token k places ahead."""
        was_training = self.draft.heads.training
        self.draft.heads.eval()
        features = self.data["features"][self.held_rows].float()  # [n, T, D]
        top1 = self.data["top1"][self.held_rows]  # [n, T]
        guesses = self.draft.vocab_map[self.draft.logits(features).argmax(-1)]  # [n, T, H]
        self.draft.heads.train(was_training)
        return [float((guesses[:, :-k, k - 1] == top1[:, k:]).float().mean())
                for k in range(1, self.draft.heads.count + 1)]

    def agreement(self) -> float:
        """The first head's held-out agreement (~greedy acceptance of the first draft token)."""
        return self.agreements()[0]

    def save(self, history: list[dict]) -> None:
        self.draft.made = {**self.draft.made, "held_out_agreement_per_head": [round(a, 4) for a in self.agreements()]}
        self.record_training(history)
        save_heads_draft(self.draft, self.out, self.target_name)


def train_heads(target: LoadedModel, draft: HeadsDraft, sequences: list[list[int]], out: str | Path,
                settings: HeadsSettings, target_name: str, progress: bool = True) -> list[dict]:
    """Train the heads within the budget (resuming from `out`), save them there; the checkpoint history."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    data = load_or_make_features(out, target, sequences, settings.features(), progress)
    if int(data["features"].shape[-1]) != int(draft.head.shape[1]):
        raise DraftlabError(f"the features in {out} were made by a target of another width; delete them")
    rows = train_rows(data, settings.held_out_fraction, settings.seq_len)
    student = HeadsStudent(draft, data, rows, out, settings, target_name)
    history = train(student, rows, LoopSettings.of(settings), out, settings.seq_len, progress, log_name=LOG)
    draft.heads.eval()
    return history
