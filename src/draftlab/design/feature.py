"""Training a feature draft (EAGLE-style) on the target's hidden states.

The target runs once over the training text (in the dtype `auto` picks: bf16
where the hardware multiplies it natively, else fp32) and its final hidden states and greedy next tokens are
cached on disk (`features.pt`); training never runs the target again. For a
pair window the draft sees real features f_0..f_{T-2} and tokens x_1..x_{T-1}
and is trained on both of EAGLE's terms:

- classification: cross-entropy of its cut-vocabulary distribution against
  the target's (the same head rows applied to the real next feature f_{t+1});
- regression: smooth L1 between its predicted feature and f_{t+1}, which keeps
  the features it feeds back to itself (draft positions 2..K) in range.

Input features get uniform noise (EAGLE's trick), so that the draft learns to
continue from its own imperfect predictions. Training runs in the shared loop
(training.py): budget, checkpoints, resume, held-out agreement.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from draftlab.design.distill import windows
from draftlab.design.training import LoopSettings, ModuleStudent, train, train_rows
from draftlab.drafters.feature import FeatureDraft, feature_loss, save_feature_draft
from draftlab.errors import DraftlabError
from draftlab.models import DTYPES, LoadedModel, batch_dtype_name
from draftlab.files.safeio import load_tensors, save_tensors
from draftlab.progress import track

FEATURES = "features.pt"
LOG = "train_log.jsonl"


@dataclass(frozen=True)
class FeatureSettings:
    """Data shape, loss weights and the training loop's settings."""

    budget_s: float = 1800.0
    seq_len: int = 256
    batch_size: int = 8
    lr: float = 1e-3
    warmup_steps: int = 20
    weight_decay: float = 0.0
    checkpoint_every_s: float = 120.0
    seed: int = 0
    max_steps: int | None = None  # a step budget instead of the wall-clock one: the same run on every host
    regression_weight: float = 1.0
    noise: float = 0.1  # uniform input-feature noise, as a fraction of the features' RMS
    held_out_fraction: float = 0.03
    feature_dtype: str = "auto"  # the target pass: auto (bf16 where native, else fp32), bf16 or fp32

    def __post_init__(self) -> None:
        if self.budget_s <= 0 or self.checkpoint_every_s <= 0:
            raise DraftlabError("budget and checkpoint interval must be positive")
        if self.seq_len < 3 or self.batch_size < 1:
            raise DraftlabError("seq_len >= 3 and batch_size >= 1 are required")
        if self.feature_dtype not in ("auto", "bf16", "fp32"):
            raise DraftlabError(f"feature dtype must be auto, bf16 or fp32, not {self.feature_dtype!r}")


@torch.inference_mode()
def target_features(target: LoadedModel, data: torch.Tensor, batch_size: int = 8, dtype: torch.dtype = torch.bfloat16,
                    progress: bool = True) -> dict:
    """The target's final hidden states [N, T, D] and greedy next tokens [N, T] on token windows [N, T].

    A converted copy of the target runs (the loaded model is not touched).
    """
    model = copy.deepcopy(target.model).to(dtype).eval()
    head = model.get_output_embeddings().weight
    features, top1 = [], []
    for start in track(range(0, data.shape[0], batch_size), "target features", unit="batch",
                       disable=not progress):
        hidden = model.model(input_ids=data[start : start + batch_size]).last_hidden_state  # [B, T, D]
        features.append(hidden.to(torch.bfloat16))
        top1.append(F.linear(hidden, head).argmax(-1).to(torch.int32))  # [B, T]
    return {"tokens": data, "features": torch.cat(features), "top1": torch.cat(top1)}


def load_or_make_features(out: Path, target: LoadedModel, sequences: list[list[int]], settings: FeatureSettings,
                          progress: bool = True) -> dict:
    """Cached features from `out`, or computed and cached."""
    path = out / FEATURES
    if path.exists():
        return load_tensors(path, "the cached target features")
    dtype = DTYPES[batch_dtype_name(settings.feature_dtype, str(target.device))]
    data = target_features(target, windows(sequences, settings.seq_len), dtype=dtype, progress=progress)
    save_tensors(data, path)
    return data


class FeatureStudent(ModuleStudent):
    """A feature draft under training, as the training loop's `Student`."""

    def __init__(self, draft: FeatureDraft, data: dict, rows: int, out: Path, settings: FeatureSettings,
                 target_name: str) -> None:
        super().__init__(draft, data, rows, out, settings, target_name)
        self.scale = float(data["features"][:64].float().pow(2).mean().sqrt())  # features' RMS
        self.generator = torch.Generator().manual_seed(settings.seed + 1)

    def loss(self, rows: list[int]) -> torch.Tensor:
        features = self.data["features"][rows].float()  # [B, T, D]
        tokens = self.data["tokens"][rows]  # [B, T]
        return feature_loss(self.draft, features, tokens, self.settings.noise * self.scale, self.generator,
                            self.settings.regression_weight)

    @torch.no_grad()
    def agreement(self) -> float:
        """Held-out top-1 agreement of the first draft token with the target's greedy token."""
        was_training = self.draft.layer.training
        self.draft.layer.eval()
        features = self.data["features"][self.held_rows].float()
        tokens = self.data["tokens"][self.held_rows]
        predicted = self.draft.predict(features[:, :-1], tokens[:, 1:])  # [n, T-1, D]
        guess = self.draft.vocab_map[self.draft.logits(predicted).argmax(-1)]  # [n, T-1]
        self.draft.layer.train(was_training)
        return float((guess == self.data["top1"][self.held_rows][:, 1:]).float().mean())

    def save(self, history: list[dict]) -> None:
        self.record_training(history)
        save_feature_draft(self.draft, self.out, self.target_name)


def train_feature_draft(target: LoadedModel, draft: FeatureDraft, sequences: list[list[int]], out: str | Path,
                        settings: FeatureSettings, target_name: str, progress: bool = True) -> list[dict]:
    """Train `draft` within the budget (resuming from `out`), save it there; the checkpoint history."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    data = load_or_make_features(out, target, sequences, settings, progress)
    rows = train_rows(data, settings.held_out_fraction, settings.seq_len)
    draft.layer.float()  # trained in fp32 on fp32 features, whatever dtype the target runs in
    student = FeatureStudent(draft, data, rows, out, settings, target_name)
    history = train(student, rows, LoopSettings.of(settings), out, settings.seq_len, progress, log_name=LOG)
    draft.layer.to(target.dtype).eval()
    return history
