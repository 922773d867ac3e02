"""The wall-clock-budgeted training loop that every designed draft shares.

A `Student` knows its loss on a batch of rows, its held-out agreement with the
target and how to save itself; this loop owns everything else:

- AdamW with warm-up and a cosine decay over the wall-clock budget (a CPU
  user sets minutes, not steps), or over `max_steps` when set: then the run
  does the same steps whatever the host's speed, and a second run from the
  same seed writes the same weights;
- a progress bar over the budget and a step log (`train_log.jsonl`);
- a checkpoint every `checkpoint_every_s` seconds (weights, optimizer, data
  order and position, RNG state, elapsed time, history), written atomically;
  the same command resumes from it and loses at most one interval;
- the held-out agreement at every checkpoint, and the student saved there.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Protocol

import torch

from draftlab.errors import DraftlabError
from draftlab.files.safeio import load_tensors, save_tensors
from draftlab.progress import Bar

CHECKPOINT = "checkpoint.pt"


class Student(Protocol):
    """A draft being trained."""

    def trainable(self) -> list[torch.Tensor]:
        """The parameters the optimizer updates."""
        ...

    def loss(self, rows: list[int]) -> torch.Tensor:
        """Training loss on these rows of the training data."""
        ...

    def agreement(self) -> float:
        """Held-out top-1 agreement with the target (~greedy acceptance of the first draft token)."""
        ...

    def weights(self) -> dict[str, torch.Tensor]:
        """The trained weights, for a checkpoint."""
        ...

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Restore weights from a checkpoint."""
        ...

    def save(self, history: list[dict]) -> None:
        """Write the draft directory, with the training history in its record."""
        ...



class ModuleStudent:
    """A draft whose trained weights are one module (`module()`: a feature or EAGLE-3 draft's layer, decoder heads)
    under training, on `data` rows (the first `train_rows` trained on, the rest held out): all of a `Student` but its
    loss, agreement and save."""

    def __init__(self, draft, data: dict, train_rows: int, out: Path, settings, target_name: str) -> None:
        self.draft, self.data, self.out, self.settings, self.target_name = draft, data, out, settings, target_name
        self.held_rows = list(range(train_rows, data["tokens"].shape[0]))

    def module(self) -> torch.nn.Module:
        """What is trained: the draft's layer (the heads draft's subclass says its heads)."""
        return self.draft.layer

    def trainable(self) -> list[torch.Tensor]:
        params = list(self.module().parameters())
        for p in params:
            p.requires_grad_(True)
        self.module().train()
        return params

    def weights(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.module().state_dict().items()}

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        self.module().load_state_dict(weights)

    def record_training(self, history: list[dict]) -> None:
        """The training settings and history, in the record the draft is saved with."""
        self.draft.made = {**self.draft.made, "train": {"settings": asdict(self.settings), "history": history}}


def train_rows(data: dict, held_out_fraction: float, seq_len: int) -> int:
    """How many of the data's windows are trained on (the rest are held out); a one-line error with too few."""
    count = data["tokens"].shape[0]
    rows = count - max(1, int(count * held_out_fraction))
    if rows < 1:
        raise DraftlabError(f"only {count} windows of {seq_len} tokens; give more text")
    return rows

@dataclass(frozen=True)
class LoopSettings:
    """Budget, batch, optimiser and checkpointing of a training run."""

    budget_s: float = 600.0
    batch_size: int = 8
    lr: float = 2e-3
    warmup_steps: int = 10
    weight_decay: float = 0.0
    checkpoint_every_s: float = 60.0
    seed: int = 0
    max_steps: int | None = None  # a step budget instead of the wall-clock one (reproducible runs)

    @classmethod
    def of(cls, settings) -> "LoopSettings":
        """The loop's fields of a larger settings dataclass."""
        return cls(**{f.name: getattr(settings, f.name, f.default) for f in fields(cls)})

    def progress(self, step: int, elapsed: float) -> float:
        """How much of the budget is spent, 0..1: steps when `max_steps` is set, else seconds."""
        if self.max_steps:
            return min(1.0, step / self.max_steps)
        return min(1.0, elapsed / self.budget_s)


def learning_rate(settings: LoopSettings, step: int, elapsed: float) -> float:
    """Linear warm-up over steps, then cosine decay to 10% over the wall-clock budget."""
    warm = min(1.0, (step + 1) / settings.warmup_steps)
    progress = settings.progress(step, elapsed)
    return settings.lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(student: Student, train_rows: int, settings: LoopSettings, out: Path, tokens_per_row: int,
          progress: bool = True, log_name: str = "train_log.jsonl") -> list[dict]:
    """Train within the budget, resuming from `out` when a checkpoint is there; the checkpoint history."""
    params = student.trainable()
    optimizer = torch.optim.AdamW(params, lr=settings.lr, weight_decay=settings.weight_decay)
    state = _resume(out, student, optimizer, settings)
    generator = torch.Generator().manual_seed(settings.seed)
    if state.get("rng") is not None:
        generator.set_state(state["rng"])
    order = state.get("order") or torch.randperm(train_rows, generator=generator).tolist()
    history = state.get("history", [])
    step, position, elapsed = state.get("step", 0), state.get("position", 0), state.get("elapsed", 0.0)
    by_steps = bool(settings.max_steps)
    bar = Bar(settings.max_steps if by_steps else int(settings.budget_s), "train", "step" if by_steps else "s",
              disable=not progress, n=step if by_steps else int(elapsed))
    last_checkpoint = time.perf_counter()
    with (out / log_name).open("a") as log:
        while settings.progress(step, elapsed) < 1.0:
            start = time.perf_counter()
            if position + settings.batch_size > len(order):
                order, position = torch.randperm(train_rows, generator=generator).tolist(), 0
            rows = order[position : position + settings.batch_size]
            position += settings.batch_size
            loss = _step(student, optimizer, params, rows, learning_rate(settings, step, elapsed))
            step += 1
            elapsed += time.perf_counter() - start
            log.write(json.dumps({"step": step, "elapsed_s": round(elapsed, 3), "loss": round(loss, 4)}) + "\n")
            log.flush()
            bar.update((step if by_steps else int(elapsed)) - bar.n)
            bar.describe(f"loss {loss:.3f}")
            done = settings.progress(step, elapsed) >= 1.0
            if time.perf_counter() - last_checkpoint >= settings.checkpoint_every_s or done:
                history.append({"step": step, "elapsed_s": round(elapsed, 1), "loss": round(loss, 4),
                                "tokens": step * settings.batch_size * tokens_per_row,
                                "held_out_agreement": round(student.agreement(), 4)})
                _checkpoint(out, student, optimizer, step, position, elapsed, order, generator, history)
                last_checkpoint = time.perf_counter()
    bar.close()
    for p in params:
        p.requires_grad_(False)
    return history


def _step(student: Student, optimizer, params, rows: list[int], lr: float) -> float:
    for group in optimizer.param_groups:
        group["lr"] = lr
    loss = student.loss(rows)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    optimizer.step()
    return float(loss.detach())


def _checkpoint(out, student, optimizer, step, position, elapsed, order, generator, history) -> None:
    """Write the checkpoint atomically, then refresh the draft directory."""
    state = {"weights": student.weights(), "optimizer": optimizer.state_dict(), "step": step, "position": position,
             "elapsed": elapsed, "order": order, "rng": generator.get_state(), "history": history}
    save_tensors(state, out / CHECKPOINT)
    student.save(history)


def _resume(out: Path, student: Student, optimizer, settings: LoopSettings) -> dict:
    """Load the last checkpoint into the student and optimizer; {} when there is none."""
    path = out / CHECKPOINT
    if not path.exists():
        return {}
    state = load_tensors(path, "the training checkpoint")
    student.load_weights(state["weights"])
    optimizer.load_state_dict(state["optimizer"])
    print(f"train: resuming from step {state['step']} ({state['elapsed']:.0f}s of {settings.budget_s:.0f}s done)")
    return state
