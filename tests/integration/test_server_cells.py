"""llama-server's configurations as cells of a real study on the shipped SmolLM2 GGUF: measured beside draftlab's own
engine, under load, compared with the server's own plain decoding, stopped with the study; a server killed
mid-sweep ends its cell with one line and the next run resumes it.

CI builds the server and sets DRAFTLAB_REQUIRE_LLAMA_SERVER, so that a missing binary fails here instead of
skipping."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from draftlab.study.run.config import SweepConfig
from draftlab.study.answer.serving import load_summaries, server_answer
from draftlab.study.run.store import ResultsStore
from draftlab.study.run.sweep import run_sweep

pytestmark = pytest.mark.integration
TARGET = "llamacpp:smollm2-135m"


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    """Code to edit: text the answer repeats, where n-gram drafts find something."""
    path = tmp_path_factory.mktemp("prompts") / "edit.jsonl"
    code = "def area(width, height):\n    return width * height\n\ndef volume(width, height, depth):\n" \
           "    return area(width, height) * depth\n"
    path.write_text("".join(json.dumps({"id": f"e{i}", "category": "code", "prompt": f"{ask}\n\n{code}"}) + "\n"
                            for i, ask in enumerate(["Rename width to w in this code.", "Add type hints to this code.",
                                                     "Add a docstring to each function.",
                                                     "Add a test of each function."])))  # e3: the companion
    return path


def server_pids() -> set[int]:
    """llama-server processes this test process started."""
    me, out = os.getpid(), set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            name, fields = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
            if name == "llama-server" and int(fields[1]) == me and fields[0] != "Z":
                out.add(int(entry.name))
    return out


def config(prompts: Path, **changes) -> SweepConfig:
    settings = dict(targets=(TARGET,), drafters=("ngram",), ks=(3,), methods=("sps",), datasets=(str(prompts),),
                    limit=3, max_new_tokens=48, host_baselines=False, servers=("ngram-mod", "ngram-simple:16"),
                    concurrency=(1, 2), baseline_every=0, preflight_s=0)
    settings.update(changes)
    return SweepConfig(**settings)


@pytest.mark.slow
def test_server_cells_run_beside_draftlabs_engine_and_under_load(binary, prompts, tmp_path):
    store = ResultsStore(tmp_path / "study.sqlite")
    added = run_sweep(config(prompts), store, progress=False)
    rows = store.rows()
    store.close()
    # ar, sps; per concurrency 1 and 2: server-ar, ngram-mod, ngram-simple 16; three prompts each
    assert added == len(rows) == 3 * (2 + 2 * 3)
    assert not server_pids()  # every server stopped with the sweep
    # llama-server decodes on llama.cpp's default kernels, which round apart from draftlab's exact ones (and by how
    # much depends on the host's kernels): its outputs, and so their lengths, need not equal draftlab's
    plain = [r for r in rows if r["method"] == "server-ar" and r["concurrency"] == 1]
    assert len(plain) == 3 and all(0 < r["new_tokens"] <= 48 and 0 < r["prefill_s"] < r["wall_s"] for r in plain)
    loaded = [r for r in rows if r["concurrency"] == 2]  # each prompt sent beside e3, which is never timed
    assert {r["prompt_id"] for r in rows} == {"e0", "e1", "e2"}
    assert all(r["new_tokens"] < r["window_tokens"] <= r["new_tokens"] + 48 and 0 < r["latency_s"] <= r["wall_s"]
               for r in loaded)
    speculative = [r for r in rows if r["method"] == "server"]
    assert all(r["identical"] in (0, 1) for r in speculative) and sum(r["drafted"] for r in speculative) > 0
    assert all(r["identical"] == 1 for r in rows if r["method"] == "sps")  # draftlab's own: exact
    text = server_answer(load_summaries(rows))
    assert any(s.startswith("Fastest for smollm2-135m with 2 request(s) in flight") for s in text)
    deploy = [s for s in text if s.startswith("Deploy smollm2-135m on llama-server")]
    assert len(deploy) == 1 and " with: llama-server -m " in deploy[0] and "--host 127.0.0.1" in deploy[0]


@pytest.mark.slow
@pytest.mark.exhaustive  # ~42 s; tests/study/test_sweep_resume.py resumes a killed sweep in CI
def test_a_server_killed_mid_sweep_ends_its_cell_and_the_next_run_resumes_it(binary, prompts, tmp_path, capsys):
    grid = config(prompts, servers=("ngram-simple:16",), concurrency=(1,), max_new_tokens=96)
    db = tmp_path / "study.sqlite"
    store = ResultsStore(db)
    killed: list[int] = []

    def kill_a_server() -> None:
        """Kill the speculative cell's server while it answers its second prompt."""
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not killed:
            rows = [r for r in ResultsStore(db, read_only=True).rows() if r["method"] == "server"]
            if rows:
                time.sleep(0.15)
                pids = sorted(server_pids())
                if pids:
                    os.kill(pids[-1], signal.SIGKILL)  # the newest: the speculative cell's server
                    killed.append(pids[-1])
            time.sleep(0.05)

    killer = threading.Thread(target=kill_a_server)
    killer.start()
    run_sweep(grid, store, progress=False)
    killer.join()
    first = {(r["method"], r["prompt_id"]) for r in store.rows()}
    store.close()
    said = [line for line in capsys.readouterr().out.splitlines() if "ended at" in line]
    assert killed and len(said) == 1 and "llama-server exited during a request" in said[0] and "log: " in said[0]
    assert not server_pids()
    missing = {("server", p) for p in ("e0", "e1", "e2")} - first
    assert missing  # the killed cell's prompts were not stored as measured, nor as skipped
    store = ResultsStore(db)
    assert run_sweep(grid, store, progress=False) == len(missing)
    assert {(r["method"], r["prompt_id"]) for r in store.rows()} == first | missing and not store.skips()
    store.close()
    assert not server_pids()


@pytest.mark.slow
def test_bench_runs_llama_servers_types_beside_draftlab(binary, prompts):
    from draftlab.api import SpeculativeDecoder
    from draftlab.bench import BenchSettings, run_bench
    from draftlab.files.datasets import load_prompts

    decoder = SpeculativeDecoder.from_names("smollm2-135m", drafter="ngram", k=3, backend="llamacpp")
    summary = run_bench(decoder, load_prompts(str(prompts), 2), BenchSettings(32, host_baselines=False),
                        progress=False, servers=["ngram-simple:16"]).summary()
    served = summary["llama_server"]["llama-server ngram-simple K=16"]
    assert served["tokens_per_s"] > 0 and served["speedup"] > 0 and 0 <= served["identical"] <= 2
    assert served["drafted"] >= served["accepted"] > 0
    assert set(summary["host_plain_tokens_per_s"]) == {"baseline", "llama-server plain"}  # its types are not plain
    assert summary["identical"] == 2 and not server_pids()


@pytest.mark.slow
def test_the_tuners_server_round_ends_with_the_command_to_deploy(binary, prompts, tmp_path):
    from draftlab.files.datasets import load_prompts
    from draftlab.models import load_model
    from draftlab.perf.serve_race import SERVER_PLAIN, server_round

    target = load_model("smollm2-135m", backend="llamacpp")
    served = server_round(target, ("ngram", 3), ["ngram-mod", "ngram-simple:16"], load_prompts(str(prompts), 2), 32,
                          tmp_path, progress=False)
    assert set(served.tokens_per_s) == {"draftlab plain decoding", "draftlab ngram K=3", SERVER_PLAIN,
                                        "llama-server ngram-mod", "llama-server ngram-simple K=16"}
    assert served.identical["draftlab ngram K=3"] == served.identical["draftlab plain decoding"]  # both exact
    assert served.command.startswith("llama-server -m ") and "--host 127.0.0.1" in served.command
    assert ("--spec-type" in served.command) == (served.deploy != SERVER_PLAIN)
    assert served.lines()[-1].startswith(f"deploy ({served.deploy}): llama-server") and not server_pids()
