"""The study's figures as PNGs (matplotlib, no display needed).

Per target and temperature, over all datasets:
- latency (ms/token) vs K, one line per method and draft, AR as a reference line
  (the first study's figure);
- throughput vs TAR per draft (the second study's Figure 2);
- per-step time split, draft vs target vs overhead, at each draft's best K (its Figure 3);
- per-position acceptance at each draft's largest K;
- SpS vs AsG tokens/s for the same draft and K, side by side.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from draftlab.study.answer.report import ALL, CellSummary, write_csv  # noqa: E402
from draftlab.contenders.methods import AR, ASG, SPS


def draw_all(summaries: list[CellSummary], out: Path) -> list[tuple[str, str]]:
    """Draw every figure; returns (file name, title) pairs in display order."""
    figures = []
    by_group: dict[tuple, list[CellSummary]] = defaultdict(list)
    for s in summaries:
        if s.dataset == ALL:
            by_group[(s.target, s.temperature)].append(s)
    for (target, temperature), group in sorted(by_group.items()):
        tag = slug(f"{target}_t{temperature:g}")
        label = f"{target}, temperature {temperature:g}"
        for draw, name, title in (
            (_latency_vs_k, "latency_vs_k", "Latency per token vs K"),
            (_throughput_vs_tar, "throughput_vs_tar", "Throughput vs tokens per step (TAR)"),
            (_time_breakdown, "time_breakdown", "Time per step: draft vs target"),
            (_acceptance_by_position, "acceptance_by_position", "Acceptance by draft position"),
            (_sps_vs_asg, "sps_vs_asg", "SpS (draftlab) vs AsG (HF assisted generation)"),
        ):
            file = f"{name}_{tag}.png"
            if draw(group, out / file, f"{title} ({label})"):
                figures.append((file, f"{title} ({label})"))
    return figures


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text)


@dataclass(frozen=True)
class Labels:
    """A figure's words: its axes and its title."""

    x: str
    y: str
    title: str


def finish(fig, ax, path: Path, labels: Labels, integer_x: bool = False, grid: bool = True) -> bool:
    """Label the axes, add title, grid and legend, save the PNG and close the figure."""
    if integer_x:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel(labels.x)
    ax.set_ylabel(labels.y)
    ax.set_title(labels.title, fontsize=10)
    if grid:
        ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _lines(group: list[CellSummary], method: str) -> dict[str, list[CellSummary]]:
    lines: dict[str, list[CellSummary]] = defaultdict(list)
    for s in group:
        if s.method == method:
            lines[s.drafter].append(s)
    return {d: sorted(v, key=lambda s: s.k) for d, v in sorted(lines.items())}


def latency_points(group: list[CellSummary]) -> list[dict]:
    """The latency-vs-K figure's data: one point per (line, K), with the prompts it was measured on."""
    points = [{"line": f"{method.upper()} {drafter}", "k": c.k, "ms_per_token": c.ms_per_token, "prompts": c.prompts}
              for method in (SPS.name, ASG.name) for drafter, cells in _lines(group, method).items() for c in cells]
    return points + [{"line": "autoregressive", "k": 0, "ms_per_token": s.ms_per_token, "prompts": s.prompts}
                     for s in group if s.method == AR.name]


def _latency_vs_k(group, path, title) -> bool:
    """Drawn from summaries of the prompts every cell ran (`report.on_shared_prompts`); its data beside it as CSV."""
    points = latency_points(group)
    write_csv(path.with_suffix(".csv"), points)
    fig, ax = plt.subplots(figsize=(8, 5))
    for method, style in ((SPS.name, "-o"), (ASG.name, "--s")):
        for drafter in _lines(group, method):
            line = [p for p in points if p["line"] == f"{method.upper()} {drafter}"]
            ax.plot([p["k"] for p in line], [p["ms_per_token"] for p in line], style, label=f"{method.upper()} {drafter}")
    for p in points:
        if p["line"] == "autoregressive":
            ax.axhline(p["ms_per_token"], color="black", linestyle=":", label="autoregressive")
    prompts = sorted({p["prompts"] for p in points})
    shared = f", on the {prompts[0]} prompts every cell ran" if len(prompts) == 1 else ""
    return finish(fig, ax, path, Labels("draft tokens per step K", "latency (ms per generated token)", title + shared),
                  integer_x=True)


def _throughput_vs_tar(group, path, title) -> bool:
    lines = _lines(group, SPS.name)
    if not lines:
        return False
    fig, ax = plt.subplots(figsize=(8, 5))
    for drafter, cells in lines.items():
        points = [(c.tokens_per_step, c.tokens_per_s, c.k) for c in cells if c.tokens_per_step]
        ax.plot([p[0] for p in points], [p[1] for p in points], "o-", label=drafter)
        for tar, tps, k in points:
            ax.annotate(f"K={k}", (tar, tps), fontsize=7, xytext=(3, 3), textcoords="offset points")
    for s in group:
        if s.method == AR.name:
            ax.axhline(s.tokens_per_s, color="black", linestyle=":", label="autoregressive")
    return finish(fig, ax, path, Labels("tokens per step (TAR)", "throughput (tokens/s)", title))


def _best_per_drafter(group, method=SPS.name) -> list[CellSummary]:
    return [max(cells, key=lambda c: c.tokens_per_s) for cells in _lines(group, method).values()]


def _time_breakdown(group, path, title) -> bool:
    best = [c for c in _best_per_drafter(group) if c.draft_ms_per_step is not None]
    ar = [s for s in group if s.method == AR.name and s.target_ms_per_step is not None]
    cells = ar + best
    if not cells:
        return False
    fig, ax = plt.subplots(figsize=(8, 5))
    names = ["AR" if c.method == AR.name else f"{c.drafter}\nK={c.k}" for c in cells]
    draft = [c.draft_ms_per_step or 0.0 for c in cells]
    target = [c.target_ms_per_step or 0.0 for c in cells]
    overhead = [c.overhead_ms_per_step or 0.0 for c in cells]
    ax.bar(names, draft, label="draft")
    ax.bar(names, target, bottom=draft, label="target (verify + prefill)")
    ax.bar(names, overhead, bottom=[d + t for d, t in zip(draft, target)], label="overhead")
    return finish(fig, ax, path, Labels("draft (at its best K)", "time per step (ms)", title), grid=False)


def _acceptance_by_position(group, path, title) -> bool:
    lines = _lines(group, SPS.name)
    if not lines:
        return False
    fig, ax = plt.subplots(figsize=(8, 5))
    for drafter, cells in lines.items():
        curve = cells[-1].per_position_acceptance
        if curve:
            ax.plot(range(1, len(curve) + 1), curve, "o-", label=f"{drafter} (K={cells[-1].k})")
    ax.set_ylim(0, 1.05)
    return finish(fig, ax, path, Labels("draft position", "P(accepted | drafted)", title), integer_x=True)


def _sps_vs_asg(group, path, title) -> bool:
    """Pairs where both methods were lossless: a lossy cell's speed is not a speculative speedup."""
    sps = {(c.drafter, c.k): c for c in group if c.method == SPS.name and not c.lossy}
    asg = {(c.drafter, c.k): c for c in group if c.method == ASG.name and not c.lossy}
    pairs = sorted(set(sps) & set(asg))
    if not pairs:
        return False
    fig, ax = plt.subplots(figsize=(max(8, 0.5 * len(pairs)), 5))
    xs = range(len(pairs))
    ax.bar([x - 0.2 for x in xs], [sps[p].tokens_per_s for p in pairs], width=0.4, label="SpS (draftlab)")
    ax.bar([x + 0.2 for x in xs], [asg[p].tokens_per_s for p in pairs], width=0.4, label="AsG (HF)")
    ax.set_xticks(list(xs))
    ax.set_xticklabels([f"{d}\nK={k}" for d, k in pairs], fontsize=7, rotation=45, ha="right")
    return finish(fig, ax, path, Labels("draft and K", "throughput (tokens/s)", title), grid=False)
