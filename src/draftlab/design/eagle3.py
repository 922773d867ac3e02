"""Training an EAGLE-3 draft on the target's hidden states, with training-time test.

The target runs once over the training text (in the dtype `auto` picks) and
the inputs of the draft's three target layers, the final hidden states and the
greedy next tokens are cached on disk (`eagle3_features.pt`); training never
runs the target again.

Training-time test (Li et al., 2025): the draft is unrolled `ttt_steps` times
over every window at once, as it drafts at inference. Step 0 reads the real
fused features g_p = fc(taps_p) with x_{p+1}; step j >= 1 reads, at position
p + j, its own step j-1 output for p with x_{p+1+j}, and attends to the real
pairs 0..p and to its own earlier steps for p (the keys a drafted token sees in
the draft's cache). Step j's output for p is scored against the target's
distribution of x_{p+2+j} (the head rows applied to the real final hidden state
at p+1+j), weighted `step_decay`**j; there is no feature-regression term.
Training runs in the shared loop (training.py): budget (seconds or steps),
checkpoints, resume, held-out agreement.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from draftlab.design.distill import windows
from draftlab.design.training import LoopSettings, ModuleStudent, train, train_rows
from draftlab.drafters.eagle3 import Eagle3Draft, save_eagle3_draft
from draftlab.errors import DraftlabError
from draftlab.models import DTYPES, LoadedModel, batch_dtype_name
from draftlab.files.safeio import load_tensors, save_tensors
from draftlab.progress import track

FEATURES = "eagle3_features.pt"
LOG = "train_log.jsonl"


@dataclass(frozen=True)
class Eagle3Settings:
    """Data shape, training-time test and the training loop's settings."""

    budget_s: float = 900.0
    max_steps: int | None = None  # a step budget instead of seconds: the same draft from the same seed on any host
    seq_len: int = 256
    batch_size: int = 8
    lr: float = 1e-3
    warmup_steps: int = 20
    weight_decay: float = 0.0
    checkpoint_every_s: float = 120.0
    seed: int = 0
    ttt_steps: int = 3  # how many drafted positions training unrolls
    step_decay: float = 0.8  # loss weight of unrolled step j: step_decay ** j
    held_out_fraction: float = 0.03
    feature_dtype: str = "auto"  # the target pass: auto (bf16 where native, else fp32), bf16 or fp32

    def __post_init__(self) -> None:
        if self.budget_s <= 0 or self.checkpoint_every_s <= 0 or (self.max_steps is not None and self.max_steps < 1):
            raise DraftlabError("budget, step budget and checkpoint interval must be positive")
        if self.seq_len < self.ttt_steps + 2 or self.batch_size < 1 or self.ttt_steps < 1:
            raise DraftlabError("ttt_steps >= 1, seq_len >= ttt_steps + 2 and batch_size >= 1 are required")
        if self.feature_dtype not in ("auto", "bf16", "fp32"):
            raise DraftlabError(f"feature dtype must be auto, bf16 or fp32, not {self.feature_dtype!r}")


@torch.inference_mode()
def target_taps(target: LoadedModel, data: torch.Tensor, taps: tuple[int, ...], batch_size: int = 8,
                dtype: torch.dtype = torch.bfloat16, progress: bool = True) -> dict:
    """On token windows [N, T]: the inputs of layers `taps` concatenated [N, T, 3 D], the final hidden states
    [N, T, D] (both bf16) and the greedy next tokens [N, T], on the CPU. A converted copy of the target runs."""
    model = copy.deepcopy(target.model).to(dtype).eval()
    head = model.get_output_embeddings().weight
    tapped, final, top1 = [], [], []
    for start in track(range(0, data.shape[0], batch_size), "target features", unit="batch",
                       disable=not progress):
        out = model.model(input_ids=data[start : start + batch_size].to(target.device), output_hidden_states=True)
        tapped.append(torch.cat([out.hidden_states[i] for i in taps], dim=-1).to(torch.bfloat16).cpu())  # [B, T, 3D]
        final.append(out.last_hidden_state.to(torch.bfloat16).cpu())  # [B, T, D]
        top1.append(F.linear(out.last_hidden_state, head).argmax(-1).to(torch.int32).cpu())  # [B, T]
    return {"tokens": data, "taps": torch.cat(tapped), "final": torch.cat(final), "top1": torch.cat(top1),
            "tap_layers": torch.tensor(taps)}


def load_or_make_taps(out: Path, target: LoadedModel, sequences: list[list[int]], taps: tuple[int, ...],
                      settings: Eagle3Settings, progress: bool = True) -> dict:
    """Cached target features from `out` (refused if made for other layers or windows), or computed and cached."""
    path = out / FEATURES
    if path.exists():
        data = load_tensors(path, "the cached target features")
        if not isinstance(data, dict) or tuple(data.get("tap_layers", torch.tensor([])).tolist()) != tuple(taps) \
                or data["tokens"].shape[1] != settings.seq_len:
            raise DraftlabError(f"{path} holds features of other layers or windows; delete it or use another --out")
        return data
    dtype = DTYPES[batch_dtype_name(settings.feature_dtype, str(target.device))]
    data = target_taps(target, windows(sequences, settings.seq_len), taps, dtype=dtype, progress=progress)
    save_tensors(data, path)
    return data


def unrolled(draft: Eagle3Draft, taps: torch.Tensor, tokens: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Training-time test: the draft's outputs [B, T-1, D] at each of `steps` unrolled steps, on real taps
    [B, T, 3D] and tokens [B, T]. Output j at index p is the draft's state at position p + j after reading
    x_{p+1+j}; it predicts x_{p+2+j} (indices where that token lies past the window are to be ignored)."""
    layer = draft.layer
    b, t = tokens.shape
    n = t - 1
    g = draft.lift(taps[:, :n])  # [B, n, D]
    padded = torch.cat([tokens, tokens.new_zeros(b, steps)], dim=1)  # [B, T + steps]: past the window, any id
    keys, values, outputs = [], [], []
    for j in range(steps):
        embeds = F.embedding(padded[:, 1 + j : 1 + j + n], draft.embed).to(g.dtype)  # [B, n, D]
        positions = torch.arange(j, j + n, device=g.device)
        query, key, value = layer.attention_inputs(g, embeds, draft.cos[positions], draft.sin[positions])
        keys.append(key)
        values.append(value)
        out = F.scaled_dot_product_attention(query, torch.cat(keys, 2), torch.cat(values, 2),
                                             attn_mask=_ttt_mask(n, j, g.device), enable_gqa=True)
        g = layer.finish(g, out)  # [B, n, D]
        outputs.append(g)
    return outputs


def _ttt_mask(n: int, step: int, device) -> torch.Tensor:
    """Boolean [n, (step + 1) n]: query p sees the real pairs 0..p, and its own pair of each later step."""
    eye = torch.eye(n, dtype=torch.bool, device=device)
    return torch.cat([torch.ones(n, n, dtype=torch.bool, device=device).tril()] + [eye] * step, dim=1)


def ttt_loss(draft: Eagle3Draft, taps: torch.Tensor, final: torch.Tensor, tokens: torch.Tensor, steps: int,
             step_decay: float) -> torch.Tensor:
    """Cross-entropy of each unrolled step against the target's distribution over the draft vocabulary, on taps
    [B, T, 3D], final hidden states [B, T, D] (fp32) and tokens [B, T]; step j weighted step_decay ** j."""
    n = tokens.shape[1] - 1
    total = taps.new_zeros(())
    for j, hidden in enumerate(unrolled(draft, taps, tokens, steps)):
        valid = n - j  # indices whose predicted token x_{p+2+j} lies in the window
        with torch.no_grad():
            target_probs = torch.softmax(F.linear(final[:, 1 + j : 1 + j + valid], draft.head), -1)  # [B, v, V']
        log_draft = torch.log_softmax(draft.logits(hidden[:, :valid]), dim=-1)  # [B, v, V']
        total = total + step_decay**j * -(target_probs * log_draft).sum(-1).mean()
    return total


class Eagle3Student(ModuleStudent):
    """An EAGLE-3 draft under training, as the training loop's `Student`."""

    def loss(self, rows: list[int]) -> torch.Tensor:
        data, device = self.data, self.draft.embed.device
        return ttt_loss(self.draft, data["taps"][rows].to(device).float(), data["final"][rows].to(device).float(),
                        data["tokens"][rows].to(device), self.settings.ttt_steps, self.settings.step_decay)

    @torch.no_grad()
    def agreement(self) -> float:
        """Held-out top-1 agreement of the first draft token with the target's greedy token."""
        return self.agreements(1)[0]

    @torch.no_grad()
    def agreements(self, steps: int) -> list[float]:
        """Held-out top-1 agreement with the target's greedy token at each of `steps` drafted positions, each
        after the draft's own earlier outputs (the target's tokens before it)."""
        was_training = self.draft.layer.training
        self.draft.layer.eval()
        data, rows, device = self.data, self.held_rows, self.draft.embed.device
        hidden = unrolled(self.draft, data["taps"][rows].to(device).float(), data["tokens"][rows].to(device), steps)
        n, top1 = data["tokens"].shape[1] - 1, data["top1"][rows]
        result = []
        for j, h in enumerate(hidden):
            guess = self.draft.vocab_map[self.draft.logits(h[:, : n - j]).argmax(-1).cpu()]  # [n_rows, n - j]
            result.append(round(float((guess == top1[:, 1 + j :]).float().mean()), 4))
        self.draft.layer.train(was_training)
        return result

    def save(self, history: list[dict]) -> None:
        history[-1]["held_out_agreement_by_depth"] = self.agreements(self.settings.ttt_steps)
        self.record_training(history)
        save_eagle3_draft(self.draft, self.out, self.target_name)


def train_eagle3_draft(target: LoadedModel, draft: Eagle3Draft, sequences: list[list[int]], out: str | Path,
                       settings: Eagle3Settings, target_name: str, progress: bool = True) -> list[dict]:
    """Train `draft` within the budget (resuming from `out`), save it there; the checkpoint history."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    data = load_or_make_taps(out, target, sequences, draft.taps, settings, progress)
    rows = train_rows(data, settings.held_out_fraction, settings.seq_len)
    draft.layer.float()  # trained in fp32 on fp32 features, whatever dtype the target runs in
    draft.head = draft.head.float()
    student = Eagle3Student(draft, data, rows, out, settings, target_name)
    history = train(student, rows, LoopSettings.of(settings), out, settings.seq_len, progress, log_name=LOG)
    draft.layer.to(target.dtype).eval()
    draft.head = draft.head.to(target.dtype)
    return history
