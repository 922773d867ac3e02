"""Distillation: train a designed draft to match the target's next-token distributions.

Token-level knowledge distillation from the target's logits on real text
(prompt sets, the target's own generations, any user corpus), sized for a CPU:

- the teacher runs once: its top-k logits per position are cached on disk, so
  training never runs the target again;
- the student is small (a few layers) and may have a cut vocabulary, which
  shrinks the LM head, the largest part of its cost;
- the loss is the cross-entropy of the student against the teacher's top-k
  distribution (renormalised), which equals their KL divergence up to a constant;
- the shared training loop (training.py): AdamW, warm-up and cosine over the
  wall-clock budget, atomic checkpoints, resume, held-out agreement.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from draftlab.design.training import LoopSettings, train
from draftlab.drafters.designed import DesignedDraft, draft_state, save_draft
from draftlab.errors import DraftlabError
from draftlab.models import LoadedModel
from draftlab.files.safeio import load_tensors, save_tensors
from draftlab.progress import track

TEACHER = "teacher.pt"
LOG = "distill_log.jsonl"


@dataclass(frozen=True)
class DistillSettings:
    """Budget, batch shape, optimiser and checkpointing."""

    budget_s: float = 600.0
    seq_len: int = 128
    batch_size: int = 8
    lr: float = 2e-3
    warmup_steps: int = 10
    weight_decay: float = 0.0
    top_k: int = 32
    checkpoint_every_s: float = 60.0
    held_out_fraction: float = 0.05
    seed: int = 0

    def __post_init__(self) -> None:
        if self.budget_s <= 0 or self.checkpoint_every_s <= 0:
            raise DraftlabError("budget and checkpoint interval must be positive")
        if self.seq_len < 2 or self.batch_size < 1 or self.top_k < 1:
            raise DraftlabError("seq_len >= 2, batch_size >= 1 and top_k >= 1 are required")


def windows(sequences: list[list[int]], seq_len: int) -> torch.Tensor:
    """All token sequences concatenated and cut into [N, seq_len] windows."""
    flat = [t for seq in sequences for t in seq]
    count = len(flat) // seq_len
    if count < 2:
        raise DraftlabError(f"only {len(flat)} tokens of training text; need at least {2 * seq_len}")
    return torch.tensor(flat[: count * seq_len], dtype=torch.long).view(count, seq_len)


@torch.inference_mode()
def teacher_targets(target: LoadedModel, data: torch.Tensor, top_k: int, progress: bool = True) -> dict:
    """The target's top-k logits at every position of every window: values [N, T, k], indices [N, T, k]."""
    values, indices = [], []
    for row in track(data, "teacher", unit="window", disable=not progress):
        logits = target.model(input_ids=row[None]).logits[0].float()  # [T, V]
        top = torch.topk(logits, top_k, dim=-1)
        values.append(top.values.to(torch.bfloat16))
        indices.append(top.indices.to(torch.int32))
    return {"tokens": data, "values": torch.stack(values), "indices": torch.stack(indices)}


def load_or_make_teacher(out: Path, target: LoadedModel, sequences: list[list[int]], settings: DistillSettings,
                         progress: bool = True) -> dict:
    """Cached teacher targets from `out`, or computed and cached."""
    path = out / TEACHER
    if path.exists():
        return load_tensors(path, "the cached teacher targets")
    teacher = teacher_targets(target, windows(sequences, settings.seq_len), settings.top_k, progress)
    save_tensors(teacher, path)
    return teacher


def soft_cross_entropy(student_logits: torch.Tensor, teacher_values: torch.Tensor, teacher_rows: torch.Tensor,
                       valid: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the student [B, T, V'] against teacher top-k probs over draft rows [B, T, k].

    Teacher tokens outside a cut vocabulary are dropped and the rest renormalised; a position
    whose top-k lies wholly outside it carries no signal and is left out of the mean.
    """
    masked = teacher_values.float().masked_fill(~valid, float("-inf"))
    teacher_probs = torch.softmax(masked, dim=-1).nan_to_num(0.0)  # [B, T, k]; all-masked rows -> 0
    log_student = torch.log_softmax(student_logits.float(), dim=-1)  # [B, T, V']
    picked = log_student.gather(-1, teacher_rows.clamp_min(0)).masked_fill(~valid, 0.0)  # [B, T, k]
    per_position = -(teacher_probs * picked).sum(-1)  # [B, T]
    return per_position.sum() / valid.any(-1).sum().clamp_min(1)


def to_draft_rows(indices: torch.Tensor, row_of: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher token ids -> draft output rows (-1 where the cut vocabulary lacks the token), and a mask."""
    if row_of is None:
        rows = indices.long()
    else:
        rows = row_of[indices.long()]
    return rows, rows >= 0


def row_lookup(vocab_map: torch.Tensor | None, vocab_size: int) -> torch.Tensor | None:
    """For each target id, its draft row or -1: [V]."""
    if vocab_map is None:
        return None
    lookup = torch.full((vocab_size,), -1, dtype=torch.long)
    lookup[vocab_map] = torch.arange(len(vocab_map))
    return lookup


@torch.inference_mode()
def held_out_agreement(draft: DesignedDraft, teacher: dict, rows: torch.Tensor) -> float:
    """Top-1 agreement of the draft with the teacher's argmax on held-out windows (~greedy acceptance)."""
    model = draft.model.model
    was_training = model.training
    model.eval()
    predicted = model(input_ids=teacher["tokens"][rows]).logits.argmax(-1)  # [n, T]
    if draft.vocab_map is not None:
        predicted = draft.vocab_map[predicted]
    expected = teacher["indices"][rows][..., 0].long()
    model.train(was_training)
    return float((predicted == expected).float().mean())


class _LayerStudent:
    """A layer draft under distillation, as the training loop's `Student`."""

    def __init__(self, draft: DesignedDraft, teacher: dict, train_rows: int, lookup: torch.Tensor | None,
                 out: Path, settings: DistillSettings, target_name: str) -> None:
        self.draft, self.teacher, self.lookup = draft, teacher, lookup
        self.out, self.settings, self.target_name = out, settings, target_name
        self.held_rows = torch.arange(train_rows, teacher["tokens"].shape[0])
        self.model = draft.model.model

    def trainable(self) -> list[torch.Tensor]:
        self.model.model.embed_tokens.weight.requires_grad_(False)  # shared with the target: never trained
        params = [p for n, p in self.model.named_parameters() if "embed_tokens" not in n]
        for p in params:
            p.requires_grad_(True)
        self.model.train()
        return params

    def loss(self, rows: list[int]) -> torch.Tensor:
        tokens = self.teacher["tokens"][rows]  # [B, T]
        draft_rows, valid = to_draft_rows(self.teacher["indices"][rows], self.lookup)  # [B, T, k]
        logits = self.model(input_ids=tokens).logits  # [B, T, V']
        return soft_cross_entropy(logits, self.teacher["values"][rows], draft_rows, valid)

    def agreement(self) -> float:
        return held_out_agreement(self.draft, self.teacher, self.held_rows)

    def weights(self) -> dict[str, torch.Tensor]:
        return draft_state(self.draft)

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        own = {("model." + k if k.startswith("layers.") or k == "norm.weight" else k): v
               for k, v in weights.items() if k != "vocab_map"}
        self.model.load_state_dict(own, strict=False)

    def save(self, history: list[dict]) -> None:
        self.draft.made = {**self.draft.made, "distill": {"settings": asdict(self.settings), "history": history}}
        save_draft(self.draft, self.out, self.target_name)


def distill(target: LoadedModel, draft: DesignedDraft, sequences: list[list[int]], out: str | Path,
            settings: DistillSettings, target_name: str, progress: bool = True) -> DesignedDraft:
    """Train `draft` within the budget (resuming from `out` when a checkpoint is there); save it to `out`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    teacher = load_or_make_teacher(out, target, sequences, settings, progress)
    count = teacher["tokens"].shape[0]
    train_rows = count - max(1, int(count * settings.held_out_fraction))
    student = _LayerStudent(draft, teacher, train_rows, row_lookup(draft.vocab_map, target.vocab_size), out,
                            settings, target_name)
    train(student, train_rows, LoopSettings.of(settings), out, settings.seq_len, progress, log_name=LOG)
    draft.model.model.eval()
    return draft
