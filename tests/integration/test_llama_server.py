"""llama-server started, driven and stopped by draftlab: real servers on the shipped SmolLM2 GGUF.

The server is built by scripts/build-llama-cpp.sh (CI runs it, and sets DRAFTLAB_REQUIRE_LLAMA_SERVER so that a
missing binary fails here instead of skipping)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from draftlab.errors import DraftlabError
from draftlab.contenders.llama_server import LlamaServer, ServerConfig, exact_server, server_binary
from draftlab.contenders.methods import method_of
from draftlab.measure import DECODE, END_TO_END, EncodedPrompt, RunSettings, measure, run_once
from draftlab.models import gguf_path

pytestmark = pytest.mark.integration
CONTEXT = 1024
PROMPTS = [EncodedPrompt("a", "code", [1, 504, 3224, 282, 253, 8446, 1217, 30, 2]),
           EncodedPrompt("b", "code", [1, 12060, 253, 1217, 338, 5564, 35, 51, 35, 51, 35, 51, 35])]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as stat:  # a zombie is dead too
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_plain_decoding_repeats_exactly_and_the_server_stops(binary, tmp_path):
    with LlamaServer(ServerConfig(gguf_path("smollm2-135m"), context=CONTEXT), tmp_path) as server:
        measured = measure({"first": server.contender(CONTEXT), "second": server.contender(CONTEXT)}, PROMPTS,
                           RunSettings(32), warmup=1)
        pid = server.process.pid
        assert server.log.exists() and alive(pid)
    first, second = measured.records["first"], measured.records["second"]
    assert [r.token_ids for r in first] == [r.token_ids for r in second]
    assert all(r.new_tokens == 32 and 0 < r.stats.prefill_s < r.seconds(END_TO_END) for r in first)
    assert all(0 < r.seconds(DECODE) < r.seconds(END_TO_END) for r in first)
    assert not alive(pid)  # stopped on leaving the block


@pytest.mark.slow
def test_servers_that_differ_only_in_speculation_prefill_a_prompt_once_bitwise(binary, tmp_path):
    """One prefill of a prompt for a plain server and an n-gram server of the same file: the second loads the
    first's slot file, which is byte for byte what its own prefill saves, and decodes from it as from its own."""
    from draftlab.contenders.served import PrefillShare
    from draftlab.measure.loop import prefill_once

    model = gguf_path("smollm2-135m")
    plain = ServerConfig(model, context=CONTEXT)
    ngram = ServerConfig(model, spec_type="ngram-mod", context=CONTEXT, extra=("--spec-ngram-mod-n-max", "4"))
    drafted = ServerConfig(model, spec_type="draft-simple", draft=model, context=CONTEXT)
    assert plain.prefill_group() == ngram.prefill_group() != ""
    assert drafted.prefill_group() == "" and ServerConfig(model, slots=2).prefill_group() == ""
    assert plain.prefill_group() != ServerConfig(model, context=2 * CONTEXT).prefill_group()
    prompt, settings = PROMPTS[1], RunSettings(32)
    with LlamaServer(plain, tmp_path) as first, LlamaServer(ngram, tmp_path) as second:
        share = PrefillShare(plain.prefill_group())
        runs = [first.contender(CONTEXT, share=share), second.contender(CONTEXT, share=share)]
        assert runs[0].prefill_key == runs[1].prefill_key
        records = prefill_once(runs, prompt)
        assert list(records) == [runs[0].prefill_key]  # one timed prefill for both
        copied = second.completion(prompt.ids, settings, cache_prompt=True)
        second.prefill(prompt.ids)
        second.save_prompt("own.bin")
        own = second.completion(prompt.ids, settings, cache_prompt=True)
    shared = f"prefill-{share.name}.bin"
    assert sorted(f.name for f in (tmp_path / "slots").iterdir()) == sorted([shared, "own.bin"])
    assert (tmp_path / "slots" / shared).read_bytes() == (tmp_path / "slots" / "own.bin").read_bytes()
    assert copied["tokens"] == own["tokens"] and len(own["tokens"]) == 32
    assert copied["timings"]["prompt_n"] <= 1  # it started from the loaded slot, not a prefill of its own


@pytest.mark.slow
def test_a_speculative_type_runs_and_reports_its_counters(binary, tmp_path):
    config = ServerConfig(gguf_path("smollm2-135m"), spec_type="ngram-simple", draft_n_max=8, context=CONTEXT)
    assert "--spec-type ngram-simple" in config.command() and "--spec-draft-n-max 8" in config.command()
    with LlamaServer(config, tmp_path) as server:
        runs = [run_once("ngram", server.contender(CONTEXT), p, RunSettings(48)) for p in PROMPTS]
    assert all(r.new_tokens == 48 and r.stats.drafted >= r.stats.accepted >= 0 for r in runs)
    assert all(r.stats.steps == r.new_tokens - r.stats.accepted for r in runs)


@pytest.mark.slow
def test_a_server_killed_mid_study_ends_the_run_with_one_line(binary, tmp_path):
    with LlamaServer(ServerConfig(gguf_path("smollm2-135m"), context=CONTEXT), tmp_path) as server:
        server.process.send_signal(signal.SIGKILL)
        server.process.wait()
        with pytest.raises(DraftlabError, match="llama-server exited during a request") as info:
            run_once("plain", server.contender(CONTEXT), PROMPTS[0], RunSettings(8))
    assert "\n" not in str(info.value) and str(server.log) in str(info.value)


@pytest.mark.slow
def test_start_failures_are_one_line_naming_the_cause(binary, tmp_path):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(DraftlabError, match="llama-server refused the model") as info:
        LlamaServer(ServerConfig(broken), tmp_path).start()
    assert "\n" not in str(info.value) and "log:" in str(info.value)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(DraftlabError, match="the port is taken") as info:
            LlamaServer(ServerConfig(gguf_path("smollm2-135m"), context=CONTEXT), tmp_path,
                        port=taken.getsockname()[1]).start()
    assert "\n" not in str(info.value)
    with pytest.raises(DraftlabError, match="unknown llama-server --spec-type"):
        ServerConfig(broken, spec_type="ngram-nope")
    with pytest.raises(DraftlabError, match="draft model"):
        ServerConfig(broken, spec_type="draft-simple")


@pytest.mark.slow
def test_a_missing_binary_says_how_to_build_it(monkeypatch, tmp_path):
    monkeypatch.setenv("DRAFTLAB_LLAMA_SERVER", str(tmp_path / "nowhere"))
    with pytest.raises(DraftlabError, match="build it with scripts/build-llama-cpp.sh"):
        server_binary()


@pytest.mark.slow
@pytest.mark.exhaustive  # ~28 s; test_exact_kernels.py proves the same on the quick study's pure Q4_0 in CI
def test_the_servers_own_speculation_on_the_exact_build_equals_its_plain_decoding(binary, tmp_path):
    """What ranks llama-server's speculation with the lossless on draftlab's build: every greedy output of its n-gram
    types at K 3 and 6 equals its plain decoding, token for token, on the shipped Q4_1 (unrepacked, the tiled matmul
    off; tests/integration/test_exact_kernels.py covers the repacked pure Q4_0); another build is not ranked so."""
    from draftlab.api import prompt_ids
    from draftlab.files.datasets import load_prompts
    from draftlab.models import gguf_tokenizer

    assert exact_server() and method_of("server").exact
    path = gguf_path("smollm2-135m")
    prompts = [prompt_ids(gguf_tokenizer(str(path)), p) for p in load_prompts("code-edit", 4)]
    settings = RunSettings(64)
    configs = [ServerConfig(path, context=CONTEXT)] + [ServerConfig(path, spec_type=kind, draft_n_max=k,
                                                                    context=CONTEXT)
                                                       for kind in ("ngram-simple", "ngram-mod") for k in (3, 6)]
    outputs, accepted = [], 0
    for config in configs:
        with LlamaServer(config, tmp_path) as server:
            answers = [server.completion(ids, settings) for ids in prompts]
        outputs.append([a["tokens"] for a in answers])
        accepted += sum(a["timings"].get("draft_n_accepted", 0) for a in answers)
    assert all(o == outputs[0] for o in outputs[1:]) and accepted > 0


def test_a_server_without_the_exact_kernels_is_not_ranked_lossless(monkeypatch, tmp_path):
    fake = tmp_path / "llama-server"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setenv("DRAFTLAB_LLAMA_SERVER", str(fake))
    assert not exact_server() and not method_of("server").exact and not method_of("server").lossless


SCRIPT = """
import sys, time
from pathlib import Path
from draftlab.contenders.llama_server import LlamaServer, ServerConfig
from draftlab.models import gguf_path
server = LlamaServer(ServerConfig(gguf_path("smollm2-135m"), context=512), Path(sys.argv[1]))
server.start()
print(server.process.pid, flush=True)
time.sleep(600)
"""


@pytest.mark.slow
def test_no_server_outlives_a_killed_study(binary, tmp_path):
    """The kernel stops the server when the process that started it dies, even by SIGKILL."""
    parent = subprocess.Popen([sys.executable, "-c", SCRIPT, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    pid = int(parent.stdout.readline())
    assert alive(pid)
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 15
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(pid)


@pytest.mark.slow
def test_a_command_line_is_read_as_the_configuration_it_runs(tmp_path):
    from draftlab.contenders.serve_check import parse_command, plain_of

    config = parse_command("llama-server -m smollm2-135m --spec-type ngram-mod --spec-draft-n-max 16 -np 2 -c 2048 "
                           "--host 0.0.0.0 --port 8080 --spec-ngram-mod-n-match 12 -fa on")
    assert config.model == gguf_path("smollm2-135m") and config.spec_type == "ngram-mod" and config.draft_n_max == 16
    assert (config.slots, config.context) == (2, 2048)
    assert config.extra == ("--spec-ngram-mod-n-match", "12", "-fa", "on")  # passed on, after draftlab's own
    flags = config.flags()
    assert "--host" not in flags and flags[-2:] == ["-fa", "on"]
    plain = plain_of(config)
    assert plain.spec_type == "" and plain.draft_n_max is None and plain.extra == ("-fa", "on")  # the flag's value too
    for bad, message in (("llama-server --spec-type ngram-mod", "names no model"),
                         ("llama-server -m smollm2-135m -np two", "needs a number"),
                         ("llama-server -m smollm2-135m -c", "needs a value"),
                         ("llama-server -m 'unclosed", "cannot read the command"),
                         (f"llama-server -m {tmp_path / 'none.gguf'}", "GGUF")):
        with pytest.raises(DraftlabError, match=message):
            parse_command(bad)


@pytest.mark.slow
def test_serve_check_measures_a_command_against_its_plain_decoding(binary, capsys):
    import json

    from draftlab.cli.main import main

    command = "llama-server -m smollm2-135m -c 1024 --spec-type ngram-simple --spec-draft-n-max 8"
    assert main(["serve-check", command, "--dataset", "code-edit", "--limit", "2", "--max-new-tokens", "32",
                 "--concurrency", "1,2", "--json"]) == 0
    out = capsys.readouterr().out
    result = json.loads(out.strip().splitlines()[-1])
    assert result["prompts"] == 2 and 0 <= result["identical"] <= 2 and result["speedup"] > 0
    assert result["decode_speedup"] > 0 and result["drafted"] >= result["accepted"] >= 0
    assert "serve-check: the command" in out and "--spec-type" not in result["plain_command"]
    assert [level["concurrency"] for level in result["load"]] == [1, 2]
    assert all(level["plain_tokens_per_s"] > 0 and level["command_latency_s"] > 0 for level in result["load"])
    assert "num_speculative_tokens_per_batch_size" in out


@pytest.mark.slow
def test_where_speculation_stops_paying_under_load():
    from draftlab.contenders.serve_check import LoadLevel, level_pays, pays_up_to
    from draftlab.deploy import per_batch_size

    def level(concurrency, speedup):
        return LoadLevel(concurrency, 100.0, 100.0 * speedup, 1.0, 1.0, 4, 4)

    paying = [level(1, 1.5), level(2, 1.2), level(4, 0.9), level(8, 1.1)]
    assert pays_up_to(paying) == 2  # the first level where it does not pay ends it
    assert per_batch_size(level_pays(paying), 3) == [[1, 2, 3], [3, 8, 0]]
    assert pays_up_to([level(1, 0.8)]) == 0 and per_batch_size(level_pays([level(1, 0.8), level(2, 0.7)]), 3) == [[1, 2, 0]]
    assert per_batch_size(level_pays([level(1, 1.3), level(4, 1.1)]), 5) == [[1, 4, 5]]
