"""llama-server configurations as study cells: their names, servers, grid, store columns and answers (no server
runs here; tests/integration/test_server_cells.py runs real ones)."""

from __future__ import annotations

import threading
import time

import pytest

from draftlab.engine import GenerationResult
from draftlab.errors import DraftlabError
from draftlab.measure import EncodedPrompt, InFlight, RunSettings, run_once
from draftlab.decoding.metrics import GenerationStats
from draftlab.study.run.cells import Cell
from draftlab.study.run.config import SweepConfig, with_weight_types
from draftlab.contenders.server_configs import parse_server_spec, spec_config
from draftlab.deploy import per_batch_size
from draftlab.study.answer.serving import choice_pays, deploy_config, level_answers, load_summaries, server_sentences
from draftlab.study.run.store import SCHEMA_VERSION, Record, ResultsStore
from tests.conftest import older_database_file


def test_a_server_spec_names_its_type_draft_and_lengths():
    assert parse_server_spec("ngram-mod").ks == () and parse_server_spec("ngram-mod:0").ks == (0,)
    assert parse_server_spec("ngram-mod").configurations() == [("ngram-mod", 0)]  # the server's default
    assert parse_server_spec("ngram-mod").configurations((2, 6)) == [("ngram-mod", 2), ("ngram-mod", 6)]
    spec = parse_server_spec("ngram-simple:16,64")
    assert (spec.spec_type, spec.draft, spec.ks, spec.drafter) == ("ngram-simple", "", (16, 64), "ngram-simple")
    both = parse_server_spec("draft-simple,ngram-mod/qwen2.5-coder-0.5b:4")
    assert both.drafter == "draft-simple,ngram-mod/qwen2.5-coder-0.5b" and both.ks == (4,)
    with_p = parse_server_spec("draft-simple/qwen2.5-coder-0.5b:3,4:0.5")
    assert with_p.configurations() == [("draft-simple/qwen2.5-coder-0.5b,p=0.5", 3),
                                       ("draft-simple/qwen2.5-coder-0.5b,p=0.5", 4)]
    for bad, why in (("ngram-fast", "unknown llama-server speculative type"), ("draft-simple", "take a draft model"),
                     ("ngram-mod/some-draft", "take a draft model"), ("ngram-mod:x", "whole lengths"),
                     ("ngram-mod:-1", ">= 0"), ("ngram-mod:4:0.5", "for draft models"),
                     ("draft-simple/d:4:1.5", "lies in \\[0, 1\\]")):
        with pytest.raises(DraftlabError, match=why):
            parse_server_spec(bad)


def test_a_configurations_server_carries_its_length_flag_and_slots(tmp_path):
    model, draft = tmp_path / "t.gguf", tmp_path / "d.gguf"
    model.write_bytes(b"")
    draft.write_bytes(b"")
    plain = spec_config(model, "none", 0, slots=2)
    assert plain.spec_type == "" and plain.slots == 2 and plain.context == 2 * 4096
    mod = spec_config(model, "ngram-mod", 16)
    assert "--spec-ngram-mod-n-max 16 --spec-ngram-mod-n-min 12" in mod.command() and mod.draft_n_max is None
    default = spec_config(model, "ngram-mod", 0)
    assert "ngram-mod-n-max" not in default.command()
    simple = spec_config(model, f"draft-simple/{draft}", 4)
    assert simple.draft == draft and simple.draft_n_max == 4 and f"-md {draft}" in simple.command()
    sure = spec_config(model, f"draft-simple/{draft},p=0.8", 4)
    assert sure.draft == draft and sure.draft_p_min == 0.8 and "--spec-draft-p-min 0.8" in sure.command()


def test_an_eagle3_server_takes_a_draft_directory_or_its_gguf(tmp_path):
    """`draft-eagle3/DIR` runs the GGUF `draftlab design eagle3 --gguf` wrote in DIR; a directory without one is
    refused with the command that writes it."""
    model, directory = tmp_path / "t.gguf", tmp_path / "e3"
    model.write_bytes(b"")
    directory.mkdir()
    with pytest.raises(DraftlabError, match=r"holds no eagle3-draft.gguf: write it with `draftlab design eagle3"):
        spec_config(model, f"draft-eagle3/{directory}", 3)
    (directory / "eagle3-draft.gguf").write_bytes(b"")
    for named in (directory, directory / "eagle3-draft.gguf"):
        config = spec_config(model, f"draft-eagle3/{named}", 3)
        assert config.draft == directory / "eagle3-draft.gguf" and config.draft_n_max == 3
        assert f"-md {directory / 'eagle3-draft.gguf'} --spec-type draft-eagle3" in config.command()
    with pytest.raises(DraftlabError, match="GGUF"):  # a draft-simple draft is a model, not a directory
        spec_config(model, f"draft-simple/{directory}", 3)


def test_the_grid_gives_gguf_targets_server_cells_at_every_concurrency():
    config = SweepConfig(targets=("llamacpp:smollm2-135m",), drafters=("ngram",), ks=(1, 4), methods=("sps",),
                         servers=("ngram-mod", "ngram-simple:8,16"), concurrency=(1, 2), host_baselines=False)
    cells = config.cells("llamacpp:smollm2-135m", "code", 0.0)
    served = [(c.method, c.drafter, c.k, c.concurrency) for c in cells if c.method.startswith("server")]
    assert served == [(m, d, k, c) for c in (1, 2) for m, d, k in (  # a type without lengths: the grid's K
        ("server-ar", "none", 0), ("server", "ngram-mod", 1), ("server", "ngram-mod", 4),
        ("server", "ngram-simple", 8), ("server", "ngram-simple", 16))]
    keys = [c.key for c in cells]
    assert len(set(keys)) == len(keys) and all(("|c=2" in c.key) == (c.concurrency == 2) for c in cells)
    torch_only = SweepConfig(targets=("smollm2-135m",), servers=("ngram-mod",), host_baselines=False)
    assert not [c for c in torch_only.cells("smollm2-135m", "code", 0.0) if c.method.startswith("server")]
    with pytest.raises(DraftlabError, match="concurrency levels"):
        SweepConfig(concurrency=(0,))
    with pytest.raises(DraftlabError, match="concurrency levels"):
        SweepConfig(concurrency=(64,))


def test_load_methods_and_load_ks_race_draftlab_serve_alone_with_k_auto_under_load():
    """The quick study's grid under load: draftlab serve's plain decoding and `--k auto` (K 0) at 4 in flight, its fixed
    K and `--k auto` alone, llama-server alone only."""
    config = SweepConfig(targets=("llamacpp:smollm2-135m",), drafters=("suffix",), ks=(2, 3), methods=("serve",),
                         servers=("ngram-mod:3",), concurrency=(1, 4), load_methods=("serve", "serve-ar"),
                         load_ks=(0,), host_baselines=False)
    cells = {(c.method, c.drafter, c.k, c.concurrency) for c in config.cells("llamacpp:smollm2-135m", "code", 0.0)}
    served = {cell for cell in cells if cell[0] != "ar"}
    assert served == {("serve-ar", "none", 0, 1), ("serve-ar", "none", 0, 4), ("serve", "suffix", 2, 1),
                      ("serve", "suffix", 3, 1), ("serve", "suffix", 0, 1), ("serve", "suffix", 0, 4),
                      ("server-ar", "none", 0, 1), ("server", "ngram-mod", 3, 1)}
    from draftlab.contenders.draftlab_serve import ServeConfig

    assert ServeConfig("x.gguf", "suffix", "auto").command().count("--k auto") == 1
    assert config.most_in_flight() == 4  # companions are held back for the level-4 cells
    unserved = SweepConfig(targets=("smollm2-135m",), methods=("sps", "serve"), concurrency=(1, 4))
    assert unserved.most_in_flight() == 1  # draftlab serve runs GGUF targets only: no prompt is held back
    with pytest.raises(DraftlabError, match="load_ks"):
        SweepConfig(load_ks=(-1,))


def test_a_cell_alone_keeps_the_key_older_studies_stored():
    cell = Cell("smollm2-135m", "ngram", 3, "sps", "code", 0.0, 64)
    assert cell.key == "smollm2-135m|sps|ngram|k=3|code|t=0.0|n=64|seed=0|fp32|auto|cpu|skip=0"
    loaded = Cell("llamacpp:x", "ngram-mod", 0, "server", "code", 0.0, 64, concurrency=4)
    assert loaded.baseline().concurrency == 1 and loaded.engine_baseline().concurrency == 4
    assert loaded.engine_baseline().method == "server-ar"


def test_weight_types_add_the_llamacpp_targets_in_each_type():
    config = with_weight_types(SweepConfig(targets=("smollm2-135m", "llamacpp:smollm2-135m")), ("bf16", "Q8_0"))
    assert config.targets == ("smollm2-135m", "llamacpp:smollm2-135m", "llamacpp:smollm2-135m@BF16",
                              "llamacpp:smollm2-135m@Q8_0")
    with pytest.raises(DraftlabError, match="unknown weight type"):
        with_weight_types(config, ("Q3_X",))
    with pytest.raises(DraftlabError, match="name a llama.cpp target"):
        with_weight_types(SweepConfig(targets=("smollm2-135m",)), ("BF16",))


def test_a_version_6_study_gains_the_load_columns(tmp_path):
    db = tmp_path / "v6.sqlite"
    cell = Cell("t", "ngram", 2, "sps", "code", 0.0, 16)
    older_database_file(db, "6", record=Record(cell, "p1", "code", 16, 8, 10, 8))
    store = ResultsStore(db)
    row = store.rows()[0]
    assert store.get_meta("schema_version") == SCHEMA_VERSION == "8"
    assert (row["concurrency"], row["window_tokens"], row["latency_s"]) == (1, None, None)
    loaded = Cell("t", "ngram-mod", 0, "server", "code", 0.0, 16, concurrency=2)
    store.add(Record(loaded, "p1", "code", 16, 8, 10, 8, wall_s=2.0, window_tokens=30, latency_s=1.5), 1)
    assert [(r["concurrency"], r["window_tokens"]) for r in store.rows()] == [(1, None), (2, 30)]
    store.close()


class Slot:
    """A server-like contender: answers each request after `seconds`, several at once, and counts how many it
    served together."""

    times_prefill = True
    reuses_prefill = False
    prefill_key = ""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.lock, self.now, self.most = seconds, threading.Lock(), 0, 0

    def run(self, prompt_ids, settings) -> GenerationResult:
        with self.lock:
            self.now += 1
            self.most = max(self.most, self.now)
        time.sleep(self.seconds)
        with self.lock:
            self.now -= 1
        tokens = [len(prompt_ids)] * settings.max_new_tokens
        return GenerationResult(tokens, "", GenerationStats(new_tokens=len(tokens)))

    def forgetful(self):
        return self


def test_in_flight_sends_the_window_at_once_and_keeps_the_prompts_own_output():
    slot = Slot(0.2)
    companions = (EncodedPrompt("b", "c", [1, 2]), EncodedPrompt("c", "c", [1, 2, 3]))
    record = run_once("load", InFlight(slot, companions), EncodedPrompt("a", "c", [7]), RunSettings(4))
    assert slot.most == 3 and record.token_ids == [1] * 4  # its own answer
    assert record.stats.window_tokens == 12 and 0.2 <= record.stats.latency_s <= record.stats.wall_s  # 3 at once: most


def row(method, drafter, k, c, tokens, wall, identical=None, prompt="p1", window=None):
    return {"target": "llamacpp:m", "dataset": "code", "temperature": 0.0, "concurrency": c, "method": method,
            "drafter": drafter, "k": k, "prompt_id": prompt, "new_tokens": tokens, "wall_s": wall,
            "window_tokens": window, "latency_s": wall if window is None else wall * 0.9, "identical": identical,
            "drafted": 10, "accepted": 5}


def llama_server_build(monkeypatch, tmp_path, exact: bool) -> None:
    """A llama-server binary with (or without) the marker symbols of draftlab's exact kernels, for the answers."""
    from draftlab.backends.gguf import EXACT_KERNELS

    fake = tmp_path / "llama-server"
    marks = b" ".join(b"ggml_cpu_draftlab_" + name.replace("-", "_").encode() for name in EXACT_KERNELS)
    fake.write_bytes(b"#!/bin/sh\n# " + (marks if exact else b"stock") + b"\n")
    fake.chmod(0o755)
    monkeypatch.setenv("DRAFTLAB_LLAMA_SERVER", str(fake))


def test_the_servers_speculation_is_lossless_on_the_exact_build_only(monkeypatch, tmp_path):
    rows = [row("ar", "none", 0, 1, 64, 1.0, True), row("server-ar", "none", 0, 1, 64, 0.8),
            row("server", "ngram-mod", 0, 1, 64, 0.5, True)]
    for exact in (True, False):
        llama_server_build(monkeypatch, tmp_path, exact)
        alone = [a for a in level_answers(load_summaries(rows)) if a.dataset == "code"][0]
        assert alone.fastest.exact is exact and (alone.lossless.method == "server") is exact
        deploy = server_sentences([alone], lambda target: tmp_path / "m.gguf")[-1]
        assert ("on draftlab's exact kernels)" in deploy) is exact and ("up to rounding" in deploy) is not exact


def test_the_answer_per_concurrency_ranks_rounding_apart_and_ends_with_a_command(monkeypatch, tmp_path):
    llama_server_build(monkeypatch, tmp_path, exact=False)
    rows = [row("ar", "none", 0, 1, 64, 1.0, True), row("sps", "ngram", 3, 1, 64, 0.9, True),
            row("server-ar", "none", 0, 1, 64, 0.8), row("server", "ngram-mod", 0, 1, 64, 0.5, True),
            row("server", "ngram-simple", 16, 1, 64, 0.4, False),
            row("server-ar", "none", 0, 2, 64, 1.0, window=128), row("server", "ngram-mod", 0, 2, 64, 0.9, True, window=128),
            row("server", "ngram-simple", 16, 2, 64, 0.7, False, window=128),
            row("server-ar", "none", 0, 4, 64, 1.0, window=256), row("server", "ngram-mod", 0, 4, 64, 1.2, True, window=256)]
    answers = [a for a in level_answers(load_summaries(rows)) if a.dataset == "code"]
    alone = answers[0]
    assert alone.concurrency == 1 and alone.fastest.drafter == "ngram-simple" and not alone.fastest.exact
    assert alone.lossless.method == "server-ar"  # exact plain decoding, faster than draftlab's sps here
    assert alone.clean.drafter == "ngram-mod" and alone.gain(alone.clean) == pytest.approx(0.8 / 0.5)
    assert answers[1].server_plain.tokens_per_s == 128 and answers[1].gain(alone.clean) == pytest.approx(1 / 0.9)
    assert answers[2].gain(alone.server_types[0]) is None  # ngram-simple did not run at 4
    model = tmp_path / "m.gguf"
    config = deploy_config(answers, model)  # the fastest whose outputs all matched, up to where it pays
    assert config.spec_type == "ngram-mod" and config.slots == 2
    assert per_batch_size(choice_pays(answers, alone.clean), alone.clean.k or -1) == [[1, 2, -1], [3, 4, 0]]
    text = server_sentences(answers, lambda target: model)
    assert text[0].startswith("On llama-server for m, one request at a time: ")  # the Use line ranks across engines
    assert "best speculation with every output identical, llama-server ngram-mod" in text[0]
    assert "lossless only up to rounding: 0/1 outputs identical" in text[1]  # under load: the fastest of all
    assert text[1].startswith("Fastest for m with 2 request(s) in flight")
    assert "[[1, 2, -1], [3, 4, 0]]" in text[-2]
    assert text[-1].startswith("Deploy m on llama-server (its own speculation: every output identical to its plain "
                               "decoding here, but exact only up to rounding") and "-np 2" in text[-1]
    lossy_only = [r for r in rows if r["drafter"] != "ngram-mod"]
    text = server_sentences(level_answers(load_summaries(lossy_only)), lambda target: model)
    assert text[-1].startswith("Deploy m on llama-server (plain decoding: no speculative type kept every output")
    assert "--spec-type" not in text[-1] and "-np 1" in text[-1]


def test_weight_types_are_compared_on_speed_size_and_outputs(monkeypatch, tmp_path):
    from draftlab.study.answer.report import summarize
    from draftlab.study.answer.weight_types import format_weight_types, weight_type_rows, weight_type_sentences

    def record(target, method, drafter, k, wall, sha, prompt):
        return {**row(method, drafter, k, 1, 64, wall, True if method == "ar" else None, prompt), "target": target,
                "output_sha": sha, "prefill_s": 0.1, "steps": 64, "draft_s": 0.0, "target_s": 0.0, "overhead_s": 0.0,
                "accepted_per_step": [], "drafted_per_step": [], "levels_per_step": [], "backend": "llamacpp",
                "finished_at": None, "cell": f"{target}|{method}|{drafter}|{k}|{prompt}"}

    llama_server_build(monkeypatch, tmp_path, exact=False)
    shipped, bf16 = "llamacpp:m", "llamacpp:m@BF16"
    rows = [record(t, m, d, k, wall, sha, p) for p in ("p1", "p2") for t, m, d, k, wall, sha in (
        (shipped, "ar", "none", 0, 1.0, f"a{p}"), (shipped, "server-ar", "none", 0, 0.8, f"a{p}"),
        (bf16, "ar", "none", 0, 0.9, "a" + p if p == "p1" else "other"), (bf16, "server", "ngram-mod", 0, 0.5, "x"))]
    table = weight_type_rows(summarize(rows), rows, lambda source: {"m": 90e6, "m@BF16": 270e6}[source])
    assert [(r.weight_type, r.megabytes, r.identical_to_shipped, r.prompts) for r in table] == [
        ("shipped", 90.0, 2, 2), ("BF16", 270.0, 1, 2)]
    assert table[1].best.startswith("server ngram-mod") and "up to rounding" in table[1].best
    sentence = weight_type_sentences(table)[0]
    assert sentence.startswith("Weight type for m: the fastest is BF16") and "1.60x the shipped type's plain" in sentence
    assert "270 MB against 90 MB shipped" in sentence and "on 1/2 prompts" in sentence
    assert "BF16" in format_weight_types(table)


def test_a_study_at_several_concurrency_levels_exports_its_k_per_batch_size_to_vllm():
    """The chosen llama-server configuration (a draft model at K=4) pays alone and at 2, not at 4: vLLM's export of
    it carries that table; llama-server's keeps the server's own flags."""
    from draftlab.deploy import export, vllm_config
    from draftlab.study.answer.serving import server_deployables

    draft = "draft-simple/qwen2.5-coder-0.5b"
    rows = [row("server-ar", "none", 0, 1, 64, 1.0), row("server", draft, 4, 1, 64, 0.5, True),
            row("server-ar", "none", 0, 2, 64, 1.0, window=128), row("server", draft, 4, 2, 64, 0.8, True, window=128),
            row("server-ar", "none", 0, 4, 64, 1.0, window=256), row("server", draft, 4, 4, 64, 1.3, True, window=256)]
    (choice,) = server_deployables(rows)
    assert (choice.draft, choice.k, choice.per_batch_size) == (draft, 4, ((1, 2, 4), (3, 4, 0)))
    config = vllm_config(choice)
    assert config["method"] == "draft_model" and config["model"] == "Qwen/Qwen2.5-Coder-0.5B-Instruct"
    assert config["num_speculative_tokens_per_batch_size"] == [[1, 2, 4], [3, 4, 0]]
    assert "--spec-type draft-simple" in export(choice, "llama-server")


def test_a_drafters_fixed_ks_share_one_draftlab_serve_server_each_request_capped_at_its_k(tmp_path):
    """draftlab serve's cells of one drafter at K 1..3 (alone and at 2 in flight) start one server, at the grid's
    longest K, each cell's requests capped at its own K (`speculative.n_max`); suffix decoding, which learns from every
    request, and `--k auto` (K 0) keep a server per K; with no longest K given, every K has its own."""
    from types import SimpleNamespace

    from draftlab.contenders.draftlab_serve import SERVE, DraftlabServer, DraftlabServeRun

    model = tmp_path / "t.gguf"
    model.write_bytes(b"")

    class Configs:
        """Servers that only note the configuration each cell asked for (none starts)."""

        def __init__(self, most_k: int):
            self.most_in_flight, self.most_k, self.asked = 2, most_k, []

        def contender(self, config, reuse: bool = True):
            self.asked.append(config)
            return DraftlabServeRun(DraftlabServer(config, tmp_path), 4096, reuse, None)

    def served(most_k: int, drafter: str, ks: tuple[int, ...], concurrency: int = 1):
        servers = Configs(most_k)
        source = SimpleNamespace(target=SimpleNamespace(source=str(model)), servers=servers)
        companions = (EncodedPrompt("c", "code", [1, 2]),)
        runs = [SERVE.contender(source, Cell(f"llamacpp:{model}", drafter, k, "serve", "code", 0.0, 8,
                                              concurrency=concurrency), companions) for k in ks]
        own = [run.contender if isinstance(run, InFlight) else run for run in runs]
        return [(c.k_per_load, c.slots) for c in servers.asked], [run.max_draft for run in own]

    assert served(3, "ngram", (1, 2, 3)) == ([("1:3", 2)] * 3, [1, 2, None])
    assert served(3, "ngram", (1, 3), concurrency=2) == ([("1:3", 2)] * 2, [1, None])
    assert served(3, "suffix", (1, 2)) == ([("1:1", 1), ("1:2", 1)], [None, None])
    assert served(3, "ngram", (0,)) == ([("auto", 2)], [None])
    assert served(0, "ngram", (1, 2)) == ([("1:1", 2), ("1:2", 2)], [None, None])
