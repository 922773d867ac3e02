"""Distillation: train a designed draft to match the target's next-token distributions.

Token-level knowledge distillation from the target's logits on real text
(prompt sets, the target's own generations, any user corpus), sized for a CPU:

- the teacher runs once: its top-k logits per position are cached on disk, so
  training never runs the target again;
- the student is small (a few layers) and may have a cut vocabulary, which
  shrinks the LM head, the largest part of its cost;
- the loss is the cross-entropy of the student against the teacher's top-k
  distribution (renormalised), which equals their KL divergence up to a constant;
- AdamW with warm-up and a cosine decay over the wall-clock budget;
- a checkpoint every `checkpoint_every_s` seconds (weights, optimizer, data
  position, RNG state, elapsed time), written atomically; a killed run resumes
  from the last one and loses at most one interval; the draft directory is
  refreshed at every checkpoint, with the held-out agreement measured there.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from draftlab.design.prune import DesignedDraft, build_draft, draft_state, save_draft
from draftlab.errors import DraftlabError
from draftlab.models import LoadedModel

CHECKPOINT = "checkpoint.pt"
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
    from tqdm import tqdm

    values, indices = [], []
    for row in tqdm(data, desc="teacher", unit="window", disable=not progress):
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
        return torch.load(path)
    teacher = teacher_targets(target, windows(sequences, settings.seq_len), settings.top_k, progress)
    tmp = path.with_suffix(".tmp")
    torch.save(teacher, tmp)
    tmp.replace(path)
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


def learning_rate(settings: DistillSettings, step: int, elapsed: float) -> float:
    """Linear warm-up over steps, then cosine decay to 10% over the wall-clock budget."""
    warm = min(1.0, (step + 1) / settings.warmup_steps)
    progress = min(1.0, elapsed / settings.budget_s)
    return settings.lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


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


def distill(target: LoadedModel, draft: DesignedDraft, sequences: list[list[int]], out: str | Path,
            settings: DistillSettings, target_name: str, progress: bool = True) -> DesignedDraft:
    """Train `draft` within the budget (resuming from `out` when a checkpoint is there); save it to `out`."""
    from tqdm import tqdm

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    teacher = load_or_make_teacher(out, target, sequences, settings, progress)
    count = teacher["tokens"].shape[0]
    held = max(1, int(count * settings.held_out_fraction))
    held_rows, train_rows = torch.arange(count - held, count), count - held
    lookup = row_lookup(draft.vocab_map, target.vocab_size)
    model = draft.model.model
    model.model.embed_tokens.weight.requires_grad_(False)  # shared with the target: never trained
    params = [p for n, p in model.named_parameters() if "embed_tokens" not in n]
    for p in params:
        p.requires_grad_(True)
    optimizer = torch.optim.AdamW(params, lr=settings.lr, weight_decay=settings.weight_decay)
    state = _resume(out, draft, optimizer, settings)
    generator = torch.Generator().manual_seed(settings.seed)
    if state.get("rng") is not None:
        generator.set_state(state["rng"])
    order = state.get("order") or torch.randperm(train_rows, generator=generator).tolist()
    history = state.get("history", [])
    step, position, elapsed = state.get("step", 0), state.get("position", 0), state.get("elapsed", 0.0)
    model.train()
    bar = tqdm(total=int(settings.budget_s), initial=int(elapsed), desc="distill", unit="s", disable=not progress)
    last_checkpoint = time.perf_counter()
    log = (out / LOG).open("a")
    while elapsed < settings.budget_s:
        start = time.perf_counter()
        if position + settings.batch_size > len(order):
            order, position = torch.randperm(train_rows, generator=generator).tolist(), 0
        batch = order[position : position + settings.batch_size]
        position += settings.batch_size
        loss = _train_step(model, optimizer, teacher, batch, lookup, learning_rate(settings, step, elapsed))
        step += 1
        elapsed += time.perf_counter() - start
        log.write(json.dumps({"step": step, "elapsed_s": round(elapsed, 3), "loss": round(loss, 4)}) + "\n")
        log.flush()
        bar.update(int(elapsed) - bar.n)
        bar.set_postfix_str(f"loss {loss:.3f}", refresh=False)
        if time.perf_counter() - last_checkpoint >= settings.checkpoint_every_s or elapsed >= settings.budget_s:
            agreement = held_out_agreement(draft, teacher, held_rows)
            history.append({"step": step, "elapsed_s": round(elapsed, 1), "loss": round(loss, 4),
                            "tokens": step * settings.batch_size * settings.seq_len,
                            "held_out_agreement": round(agreement, 4)})
            _checkpoint(out, draft, optimizer, settings, target_name, step, position, elapsed, order,
                        generator, history)
            last_checkpoint = time.perf_counter()
    bar.close()
    log.close()
    model.eval()
    for p in params:
        p.requires_grad_(False)
    return draft


def _train_step(model, optimizer, teacher, batch, lookup, lr) -> float:
    tokens = teacher["tokens"][batch]  # [B, T]
    rows, valid = to_draft_rows(teacher["indices"][batch], lookup)  # [B, T, k]
    for group in optimizer.param_groups:
        group["lr"] = lr
    logits = model(input_ids=tokens).logits  # [B, T, V']
    loss = soft_cross_entropy(logits, teacher["values"][batch], rows, valid)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_([p for g in optimizer.param_groups for p in g["params"]], 1.0)
    optimizer.step()
    return float(loss.detach())


def _checkpoint(out, draft, optimizer, settings, target_name, step, position, elapsed, order, generator, history):
    """Write the checkpoint atomically, then refresh the draft directory."""
    state = {"weights": draft_state(draft), "optimizer": optimizer.state_dict(), "step": step, "position": position,
             "elapsed": elapsed, "order": order, "rng": generator.get_state(), "history": history,
             "settings": asdict(settings)}
    tmp = out / (CHECKPOINT + ".tmp")
    torch.save(state, tmp)
    tmp.replace(out / CHECKPOINT)
    draft.made = {**draft.made, "distill": {"settings": asdict(settings), "history": history}}
    save_draft(draft, out, target_name)


def _resume(out: Path, draft: DesignedDraft, optimizer, settings: DistillSettings) -> dict:
    """Load the last checkpoint into the draft and optimizer; {} when there is none."""
    path = out / CHECKPOINT
    if not path.exists():
        return {}
    try:
        state = torch.load(path, weights_only=False)
    except Exception as exc:  # a torn or foreign file
        raise DraftlabError(f"cannot read checkpoint {path} ({exc}); delete it to start over") from exc
    own = {("model." + k if k.startswith("layers.") or k == "norm.weight" else k): v
           for k, v in state["weights"].items() if k != "vocab_map"}
    draft.model.model.load_state_dict(own, strict=False)
    optimizer.load_state_dict(state["optimizer"])
    print(f"distill: resuming from step {state['step']} ({state['elapsed']:.0f}s of {settings.budget_s:.0f}s done)")
    return state


def fresh_student(target: LoadedModel, layers: list[int], vocab_map: torch.Tensor | None) -> DesignedDraft:
    """A trainable draft initialised from the target's layers (copies: training never touches the target)."""
    return build_draft(target, layers, vocab_map)
