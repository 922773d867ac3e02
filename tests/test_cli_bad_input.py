"""Bad input, every subcommand: exit status 2, one line that says what to do, no traceback, no file changed."""

from __future__ import annotations

import json
import sqlite3

import pytest
import torch

from draftlab.cli import main
from draftlab.drafters.designed import build_draft, save_draft
from draftlab.models import load_model
from draftlab.study.run.store import ResultsStore
from tests.conftest import tiny_model_dir
from tests.tiers import slow


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A tiny target, damaged drafts, prompt files, databases and profiles, all in one folder."""
    root = tmp_path_factory.mktemp("bad")
    model = tiny_model_dir(root / "tiny")
    target = load_model(str(model))
    good = save_draft(build_draft(target, [0, 1], torch.arange(32)), root / "draft", "tiny")
    truncated = save_draft(build_draft(target, [0, 1]), root / "truncated", "tiny")
    weights = truncated / "weights.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    missing = save_draft(build_draft(target, [0, 1]), root / "missing-key", "tiny")
    from safetensors.torch import load_file, save_file

    state = load_file(str(missing / "weights.safetensors"))
    del state["norm.weight"]
    save_file(state, str(missing / "weights.safetensors"))
    other_vocab = load_model(str(tiny_model_dir(root / "tiny32", vocab=32)))
    save_draft(build_draft(other_vocab, [0]), root / "other-vocab", "tiny32")
    (root / "empty.jsonl").write_text("")
    (root / "bad-line.jsonl").write_text('{"prompt": "w1 w2"}\nnot json\n')
    (root / "prompts.jsonl").write_text('{"prompt": "w1 w2 w3"}\n')
    ResultsStore(root / "newer.sqlite").close()
    conn = sqlite3.connect(root / "newer.sqlite")
    conn.execute("UPDATE meta SET value = '99' WHERE key = 'schema_version'")
    conn.commit()
    conn.close()
    (root / "profile.json").write_text(json.dumps({"not": "a profile"}))
    (root / "profile-bytes.json").write_bytes(b"\xff\xfe{")
    (root / "latin1.jsonl").write_bytes('{"prompt": "caf\u00e9"}\n'.encode("latin-1"))
    (root / "twice.jsonl").write_text('{"prompt": "w1 w2", "id": "a"}\n{"prompt": "w3 w4", "id": "a"}\n')
    broken = root / "broken-config"
    broken.mkdir()
    for item in (root / "tiny").iterdir():
        (broken / item.name).write_bytes(item.read_bytes())
    (broken / "config.json").write_text("{not json")
    (root / "foreign").mkdir()
    (root / "foreign" / "responses.jsonl").write_text("[1, 2]\n[3, 4]\n[5, 6]\n")
    assert good.exists()
    return root


def cases(root):
    t = ["--target", str(root / "tiny")]
    gen = ["generate", *t, "--prompt", "w1 w2", "--no-chat", "--max-new-tokens", "4"]
    bench = ["bench", *t, "--prompts", str(root / "prompts.jsonl")]
    sweep = ["sweep", "--db", str(root / "new.sqlite"), "--targets", str(root / "tiny"), "--datasets",
             str(root / "prompts.jsonl")]
    calibrate = ["calibrate", *t, "--out", str(root / "out.json"), "--dataset", str(root / "prompts.jsonl")]
    tune = ["tune", *t, "--dataset", str(root / "prompts.jsonl")]
    distill = ["design", "distill", *t, "--out", str(root / "d-out"), "--datasets", str(root / "prompts.jsonl")]
    feature = ["design", "feature", *t, "--out", str(root / "f-out"), "--datasets", str(root / "prompts.jsonl")]
    return {
        "generate threads -1": [*gen, "--threads", "-1"],
        "generate top-p 0": [*gen, "--temperature", "1", "--top-p", "0"],
        "generate top-p > 1": [*gen, "--temperature", "1", "--top-p", "1.5"],
        "generate top-k -1": [*gen, "--top-k", "-1"],
        "generate max-new-tokens 0": [*gen, "--max-new-tokens", "0"],
        "generate temperature -1": [*gen, "--temperature", "-1"],
        "generate k 0": [*gen, "--k", "0"],
        "generate unknown dtype": [*gen, "--dtype", "fp8"],
        "generate unknown backend": [*gen, "--backend", "turbo"],
        "generate cuda without cuda": [*gen, "--device", "cuda"],
        "generate empty stop": [*gen, "--stop", ""],
        "generate unknown drafter": [*gen, "--drafter", "magic"],
        "generate missing target": ["generate", "--target", str(root / "nowhere"), "--prompt", "x"],
        "generate truncated draft": [*gen, "--drafter", f"model:{root / 'truncated'}"],
        "generate draft missing a key": [*gen, "--drafter", f"model:{root / 'missing-key'}"],
        "generate draft of another vocabulary": [*gen, "--drafter", f"model:{root / 'other-vocab'}"],
        "generate adapt a layer draft": [*gen, "--drafter", "layers:0-1", "--adapt"],
        "generate adapt bad option": [*gen, "--drafter", "designed", "--adapt", "speed=2"],
        "generate adapt-save without adapt": [*gen, "--adapt-save", str(root / "adapted")],
        "bench skip -1": [*bench, "--skip", "-1"],
        "bench limit 0": [*bench, "--limit", "0"],
        "bench missing prompt file": ["bench", *t, "--prompts", str(root / "nowhere.jsonl")],
        "bench empty prompt file": ["bench", *t, "--prompts", str(root / "empty.jsonl")],
        "bench prompt file with a bad line": ["bench", *t, "--prompts", str(root / "bad-line.jsonl")],
        "sweep K 0": [*sweep, "--ks", "0-3"],
        "sweep unknown method": [*sweep, "--methods", "magic"],
        "sweep unknown dtype": [*sweep, "--dtype", "fp8"],
        "sweep threads 0": [*sweep, "--threads", "0"],
        "sweep skip -1": [*sweep, "--skip", "-1"],
        "sweep newer database": ["sweep", "--db", str(root / "newer.sqlite"), "--targets", str(root / "tiny"),
                                 "--datasets", str(root / "prompts.jsonl")],
        "report missing database": ["report", "--db", str(root / "nowhere.sqlite"), "--out", str(root / "r")],
        "report newer database": ["report", "--db", str(root / "newer.sqlite"), "--out", str(root / "r")],
        "export newer database": ["export", "--db", str(root / "newer.sqlite"), "--out", str(root / "x.csv")],
        "calibrate k-max 0": [*calibrate, "--k-max", "0"],
        "calibrate repeats 0": [*calibrate, "--repeats", "0"],
        "calibrate unknown backend": [*calibrate, "--backend", "turbo"],
        "predict missing profile": ["predict", "--profile", str(root / "nowhere.json")],
        "predict corrupted profile": ["predict", "--profile", str(root / "profile.json")],
        "validate missing profile": ["validate", "--profile", str(root / "nowhere.json"), "--db",
                                     str(root / "newer.sqlite")],
        "tune negative budget": [*tune, "--budget", "-5"],
        "tune limit 0": [*tune, "--limit", "0"],
        "tune an adapting draft": [*tune, "--drafts", "adapt/designed"],
        "microbench steps 0": ["design", "microbench", *t, "--out", str(root / "m"), "--steps", "0"],
        "prune vocab 1": ["design", "prune", *t, "--out", str(root / "p"), "--layers", "0", "--vocab", "1"],
        "distill budget 0": [*distill, "--budget", "0"],
        "distill negative lr": [*distill, "--lr", "-1"],
        "feature seq-len 1": [*feature, "--seq-len", "1"],
        "feature init from a layer draft": [*feature, "--init", str(root / "draft")],
        "correlate k 0": ["design", "correlate", *t, "--drafts", "layers:0", "--out", str(root / "c"), "--k", "0"],
        "correlate unknown drafter": ["design", "correlate", *t, "--drafts", "magic", "--out", str(root / "c")],
        # exactness cannot be switched off by a typo
        "generate numerics exact-wm/0": [*gen, "--numerics", "fp32 exact-wm/0"],
        "generate numerics exact-wm/3": [*gen, "--numerics", "fp32 exact-wm/3"],
        "generate numerics exact-linear/-4": [*gen, "--numerics", "fp32 exact-linear/-4"],
        "generate numerics unknown route": [*gen, "--numerics", "fp32 exact-turbo/4"],
        "generate numerics exact without rows": [*gen, "--numerics", "fp32 exact-wm"],
        # numbers that are not numbers
        "generate temperature nan": [*gen, "--temperature", "nan"],
        "generate temperature inf": [*gen, "--temperature", "inf"],
        "generate top-p nan": [*gen, "--temperature", "1", "--top-p", "nan"],
        "generate adapt lr nan": [*gen, "--drafter", "designed", "--adapt", "lr=nan"],
        "generate adapt negative noise": [*gen, "--drafter", "designed", "--adapt", "noise=-1"],
        "distill lr nan": [*distill, "--lr", "nan"],
        "tune budget inf": [*tune, "--budget", "inf"],
        # text that is not UTF-8
        "generate prompt not UTF-8": ["generate", *t, "--prompt", "w1 \udcff", "--no-chat"],
        "bench prompt file not UTF-8": ["bench", *t, "--prompts", str(root / "latin1.jsonl")],
        "predict profile not UTF-8": ["predict", "--profile", str(root / "profile-bytes.json")],
        # files that are not what they are named for
        "predict profile is a directory": ["predict", "--profile", str(root / "tiny")],
        "generate broken config.json": ["generate", "--target", str(root / "broken-config"), "--prompt", "w1",
                                        "--no-chat", "--dtype", "auto"],
        "generate suffix cache over foreign files": [*gen, "--drafter", f"suffix:cache={root / 'foreign'}"],
        "generate suffix cache is a file": [*gen, "--drafter", f"suffix:cache={root / 'prompts.jsonl'}"],
        "generate adapt-save onto a file": [*gen, "--drafter", "designed", "--adapt", "--adapt-save",
                                           str(root / "prompts.jsonl")],
        # prompt sets
        "bench skip past the end": [*bench, "--skip", "5"],
        "bench prompt ids twice": ["bench", *t, "--prompts", str(root / "twice.jsonl")],
        "sweep prompt ids twice": ["sweep", "--db", str(root / "new.sqlite"), "--targets", str(root / "tiny"),
                                   "--datasets", str(root / "twice.jsonl")],
        "sweep race-after -1": [*sweep, "--race-after", "-1"],
        "sweep inverted n-gram range": [*sweep, "--drafters", "ngram:3-1"],
        "sweep n-gram size 0": [*sweep, "--drafters", "ngram:0"],
        "sweep preflight timeout NaN": [*sweep, "--preflight-timeout", "nan"],
        "bench preflight timeout -1": [*bench, "--preflight-timeout", "-1"],
        # outputs whose way is blocked by a file
        "report out under a file": ["report", "--db", str(root / "newer.sqlite"), "--out",
                                    str(root / "prompts.jsonl" / "r")],
        "export out under a file": ["export", "--db", str(root / "newer.sqlite"), "--out",
                                    str(root / "prompts.jsonl" / "x.csv")],
        "sweep db under a file": ["sweep", "--db", str(root / "prompts.jsonl" / "s.sqlite"), "--targets",
                                  str(root / "tiny"), "--datasets", str(root / "prompts.jsonl")],
        # draftlab serve: refused before it loads anything or listens
        "serve k -1": ["serve", "--drafter", "ngram", "--k", "-1"],
        "serve k not a number": ["serve", "--drafter", "ngram", "--k", "many"],
        "serve k-max 0": ["serve", "--drafter", "suffix", "--k-max", "0"],
        "serve k and k-per-load": ["serve", "--drafter", "ngram", "--k", "3", "--k-per-load", "1:3"],
        "serve k-per-load with a gap": ["serve", "--drafter", "ngram", "--k-per-load", "1:3,3-4:2"],
        "serve max-in-flight 0": ["serve", "--max-in-flight", "0"],
        "serve torch dtype on llama.cpp": ["serve", "--dtype", "bf16"],
        "serve repack on torch": ["serve", "--backend", "auto", "--numerics", "repack"],
        "serve from a missing study": ["serve", "--from", str(root / "nowhere")],
        "serve from with a drafter": ["serve", "--from", str(root), "--drafter", "ngram"],
        # trees larger than a block may hold
        "generate tree past the block limit": [*gen, "--drafter", "tree:40x40:layers:0-1", "--k", "2"],
        "generate tree deeper than a block": [*gen, "--drafter", "tree:63:layers:0-1", "--k", "10",
                                              "--max-new-tokens", "40"],
    }


def snapshot(root):
    return {p: p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


CASES = sorted(cases(__import__("pathlib").Path("/x")))


def test_the_table_has_at_least_60_cases():
    assert len(CASES) >= 60


@pytest.mark.parametrize("name", [slow(n) if n == "tune an adapting draft" else n for n in CASES])  # it trains a draft
def test_bad_input_exits_2_with_one_line(files, name, capsys):
    argv = cases(files)[name]
    before = snapshot(files)
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, f"{name}: exit {code}, stderr {err}"
    assert len(err) == 1 and err[0].startswith("draftlab: error: "), err
    assert "Traceback" not in err[0]
    assert snapshot(files) == before, f"{name} changed or created a file"
