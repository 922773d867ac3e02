"""One study, loaded once: the records and everything the store keeps beside them, and what the answer computes
from them (summaries, drift, the optimal table, the findings, the figures) as cached properties.

Every section of the answer (`draftlab.study.answer.sections`) reads this object; nothing below re-reads the database
or summarizes twice.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from draftlab.contenders.methods import method_of
from draftlab.errors import DraftlabError
from draftlab.perf.calibrate import Profile
from draftlab.perf.present import plot_comparison
from draftlab.study.answer import plots
from draftlab.study.answer.findings import Evidence, Finding, gather_evidence, seeds_findings
from draftlab.study.answer.report import on_shared_prompts, summarize
from draftlab.study.answer.serving import LoadSummary, draw_load, load_summaries
from draftlab.study.answer.summary import CellSummary
from draftlab.study.answer.tables import OptimalRow, optimal_table
from draftlab.study.run.drift import Drift, baseline_drift
from draftlab.study.run.store import LEFT_OUT, ResultsStore


@dataclass(frozen=True)
class ReportInputs:
    """What a reader adds to a study: files beside it, the output length to state, the engines to export to."""

    profile: Path | None = None  # calibration profile: the performance model's check and what-ifs
    microbench: Path | None = None  # `design microbench`'s microbench.json
    correlate: Path | None = None  # `design correlate`'s correlate.json
    output_tokens: int | None = None  # end-to-end times for outputs this long (None: the study's own)
    export: tuple[str, ...] = ()  # engines whose command for the answer is printed


@dataclass
class StudyResults:
    """A study database read once (`load`), with `figures_dir` where figures are drawn (None: no figures)."""

    db: Path
    rows: list[dict]
    params: dict[str, int]
    envs: list[dict]
    checks: list[dict]
    skips: list[dict]
    left_out: str | None  # the store's JSON list of engines the last sweep could not run
    inputs: ReportInputs = field(default_factory=ReportInputs)
    figures_dir: Path | None = None

    @classmethod
    def load(cls, db: str | Path, inputs: ReportInputs = ReportInputs(), figures_dir: Path | None = None
             ) -> StudyResults:
        """Read every table of the study database once; a missing or empty study is refused in one line."""
        if not Path(db).exists():
            raise DraftlabError(f"study database not found: {db}")
        store = ResultsStore(db, read_only=True)
        try:
            results = cls(Path(db), store.rows(), store.params(), store.environments(), store.baseline_checks(),
                          store.skips(), store.get_meta(LEFT_OUT), inputs, figures_dir)
        finally:
            store.close()
        if not results.rows:
            raise DraftlabError(f"{db} holds no records yet; run `draftlab sweep --db {db}` first")
        return results

    @cached_property
    def summaries(self) -> list[CellSummary]:
        """One summary per cell and workload, single requests only."""
        return summarize(self.rows, self.checks)

    @cached_property
    def drift(self) -> Drift:
        return baseline_drift(self.rows, self.checks)

    @cached_property
    def optimal(self) -> list[OptimalRow]:
        return optimal_table(self.summaries, self.params)

    @cached_property
    def load_summaries(self) -> list[LoadSummary]:
        """The summaries per concurrency (llama-server's cells under load among them)."""
        return load_summaries(self.rows)

    def served_as(self, s: CellSummary) -> tuple[str, int]:
        """The dtype a summary's records ran in, and the most requests at once of the study (a vLLM server serves
        every level: `contenders.vllm`)."""
        dtype = next((r["dtype"] for r in self.rows if (r["target"], r["method"], r["drafter"], r["k"])
                      == (s.target, s.method, s.drafter, s.k)), "fp32")
        return dtype, max((r.get("concurrency") or 1) for r in self.rows)

    @cached_property
    def served(self) -> list[LoadSummary]:
        return [s for s in self.load_summaries if method_of(s.method).served]

    @cached_property
    def evidence(self) -> Evidence:
        return gather_evidence(self.summaries, self.params, self.rows, self.inputs.profile, self.inputs.microbench,
                               self.inputs.correlate)

    @cached_property
    def findings(self) -> list[Finding]:
        return seeds_findings(self.evidence)

    @cached_property
    def figures(self) -> list[tuple[str, str]]:
        """(file name, title) of each figure, drawn into `figures_dir` once (none without it). The lines of a
        figure compare cells on the prompts every one of them ran."""
        if self.figures_dir is None:
            return []
        self.figures_dir.mkdir(parents=True, exist_ok=True)
        shared = summarize(on_shared_prompts(self.rows), self.checks)
        return plots.draw_all(shared, self.figures_dir) + draw_load(self.load_summaries, self.figures_dir)

    @cached_property
    def profile(self) -> Profile:
        """The calibration profile the reader gave (`inputs.profile`)."""
        return Profile.load(self.inputs.profile)

    @cached_property
    def comparison_plot(self) -> tuple[str, str] | None:
        """The performance model's predicted against measured throughput, drawn once into `figures_dir`."""
        if self.figures_dir is None or self.inputs.profile is None:
            return None
        self.figures_dir.mkdir(parents=True, exist_ok=True)
        plot_comparison(self.evidence.comparisons, self.figures_dir / "predicted_vs_measured.png")
        return "predicted_vs_measured.png", "predicted vs measured throughput"
