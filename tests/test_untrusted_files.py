"""Files draftlab did not write itself: a planted payload runs no code, a torn or foreign file loses nothing.

Every file type draftlab reads back gets a pickle whose unpickling would create a marker file (the classic
`__reduce__` payload); reading it must refuse it (or count it as missing) without running it.
"""

from __future__ import annotations

import json
import os
import pickle
import sqlite3

import pytest
import torch

from draftlab.files.datasets import load_prompts
from draftlab.design.corpus import _reused
from draftlab.design.distill import TEACHER, load_or_make_teacher
from draftlab.design.feature import FEATURES, load_or_make_features
from draftlab.design.training import CHECKPOINT, _resume
from draftlab.drafters.adapt import AdaptSettings
from draftlab.drafters.suffix import SuffixCache, read_responses
from draftlab.errors import DraftlabError
from draftlab.perf.calibrate import Profile
from draftlab.files.safeio import load_tensors, private_dir, publish_dir, save_tensors, write_atomic
from draftlab.backends.routes import parse_route
from draftlab.decoding.sampling import SamplingConfig
from draftlab.study.run.runner import _read_state
from draftlab.study.run.store import SCHEMA_VERSION, ResultsStore
from tests.conftest import older_database_file


class Payload:
    """Unpickling this runs `open(marker, 'w')`: what a hostile file would do with os.system."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def plant(path, marker) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(pickle.dumps({"weights": Payload(marker)}))
    torch.save({"weights": Payload(marker)}, path.with_suffix(".zip-pickle"))  # torch's own container too


@pytest.fixture
def marker(tmp_path):
    path = tmp_path / "PWNED"
    yield path
    assert not path.exists(), "a planted payload ran"


def test_tensor_files_refuse_a_planted_payload(tmp_path, marker):
    for name in ("adapt-0.pt", CHECKPOINT, FEATURES, "text.pt", TEACHER):
        plant(tmp_path / name, marker)
        for path in (tmp_path / name, (tmp_path / name).with_suffix(".zip-pickle")):
            with pytest.raises(DraftlabError, match="cannot read"):
                load_tensors(path, "a test file")
    assert _read_state(tmp_path / "adapt-0.pt") is None  # a sweep cell's state: counted as missing
    with pytest.raises(DraftlabError):
        _reused(tmp_path / "text.pt")  # design --reuse-text
    with pytest.raises(DraftlabError):
        load_or_make_features(tmp_path, None, [], None)  # cached features: refused before any model is needed
    with pytest.raises(DraftlabError):
        load_or_make_teacher(tmp_path, None, [], None)


def test_a_training_checkpoint_with_a_payload_is_refused(tmp_path, marker):
    plant(tmp_path / CHECKPOINT, marker)
    with pytest.raises(DraftlabError, match="training checkpoint"):
        _resume(tmp_path, None, None, None)


def test_json_sqlite_and_jsonl_files_refuse_a_payload(tmp_path, marker):
    blob = pickle.dumps(Payload(marker))
    (tmp_path / "profile.json").write_bytes(blob)
    with pytest.raises(DraftlabError, match="not a draftlab profile"):
        Profile.load(tmp_path / "profile.json")
    (tmp_path / "study.sqlite").write_bytes(blob)
    with pytest.raises(DraftlabError):
        ResultsStore(tmp_path / "study.sqlite")
    assert (tmp_path / "study.sqlite").read_bytes() == blob  # left untouched
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "responses.jsonl").write_bytes(blob + b"\n[1, 2, 3]\n")
    (cache / "suffix-cache.json").write_text(json.dumps({"format": "draftlab-suffix-cache/1", "tokenizer": ""}))
    assert read_responses(cache / "responses.jsonl") == [[1, 2, 3]]  # the damaged line is dropped
    (tmp_path / "prompts.jsonl").write_bytes(blob)
    with pytest.raises(DraftlabError):
        load_prompts(str(tmp_path / "prompts.jsonl"))


def test_writes_are_atomic_and_leave_no_temporary_files(tmp_path):
    write_atomic(tmp_path / "a.json", "[1]")
    save_tensors({"x": torch.ones(2)}, tmp_path / "b.pt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "b.pt"]
    assert torch.equal(load_tensors(tmp_path / "b.pt", "b")["x"], torch.ones(2))


def test_a_cache_directory_made_by_two_processes_at_once_is_published_whole_once(tmp_path):
    """Two processes converting the same model at once (two commands, or two test workers) each write a directory
    of their own; the first to finish publishes it, the second keeps the first's and removes its own."""
    out = tmp_path / "converted" / "model"
    theirs = out.with_name(".model.1.partial")  # another process's, as private_dir names it there
    theirs.mkdir(parents=True)
    (theirs / "config.json").write_text("theirs")
    ours = private_dir(out)
    assert ours != theirs and not any(ours.iterdir())
    (ours / "config.json").write_text("ours")
    publish_dir(theirs, out)
    assert publish_dir(ours, out) == out and (out / "config.json").read_text() == "theirs"
    assert sorted(p.name for p in out.parent.iterdir()) == ["model"]


def test_a_suffix_cache_is_never_created_over_files_that_are_not_its_own(tmp_path):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "responses.jsonl").write_text("[1]\n[2]\n[3]\n")
    with pytest.raises(DraftlabError, match="not a suffix cache"):
        SuffixCache(responses=8, store=foreign)
    assert (foreign / "responses.jsonl").read_text() == "[1]\n[2]\n[3]\n"
    with pytest.raises(DraftlabError, match="is a file"):
        SuffixCache(responses=8, store=foreign / "responses.jsonl")


def test_a_torn_append_is_closed_and_the_next_response_kept(tmp_path, capsys):
    store = tmp_path / "cache"
    cache = SuffixCache(responses=8, store=store)
    request = cache.start([1, 2])
    cache.extend(request, [3, 4])
    cache.stop(request, [3, 4])
    with open(store / "responses.jsonl", "a") as handle:
        handle.write("[5, 6")  # a kill mid-append
    again = SuffixCache(responses=8, store=store)
    request = again.start([1])
    again.extend(request, [7, 8])
    again.stop(request, [7, 8])
    assert read_responses(store / "responses.jsonl") == [[3, 4], [7, 8]]
    assert "1 damaged line" in capsys.readouterr().err
    (store / "responses.jsonl").write_text("[1, 4294967296]\n[2, -1]\n[9]\n")  # ids past int32, negative
    assert read_responses(store / "responses.jsonl") == [[9]]


def test_exactness_and_numbers_are_checked_not_trusted():
    for text in ("fp32 exact-wm/0", "fp32 exact-wm/3", "bf16 exact-linear/32", "fp32 exact-wm/x", "fp32 exact-wm"):
        with pytest.raises(DraftlabError):
            parse_route(text)
    assert parse_route("fp32 exact-wm/4").exact and not parse_route("fp32 linear").exact
    for value in (float("nan"), float("inf"), -1.0):
        with pytest.raises(DraftlabError):
            SamplingConfig(value)
    with pytest.raises(DraftlabError):
        SamplingConfig(1.0, top_p=float("nan"))
    for options in ("lr=nan", "lr=inf", "noise=-1", "noise=nan"):
        with pytest.raises(DraftlabError):
            AdaptSettings.parse(options)


def test_read_only_commands_migrate_a_copy_and_one_sweep_writes_at_a_time(tmp_path):
    db = tmp_path / "old.sqlite"
    older_database_file(db, "5")
    before = db.read_bytes()
    reader = ResultsStore(db, read_only=True)
    assert reader.skips() == [] and reader.get_meta("schema_version") == SCHEMA_VERSION
    reader.close()
    assert db.read_bytes() == before  # reading migrated a copy in memory
    writer = ResultsStore(db)
    assert writer.get_meta("schema_version") == SCHEMA_VERSION
    with writer.writing():
        other = ResultsStore(db)
        with pytest.raises(DraftlabError, match="another sweep is writing"):
            with other.writing():
                pass
        other.close()
    writer.close()


def test_a_migration_killed_halfway_leaves_the_old_version_whole(tmp_path):
    db = tmp_path / "v4.sqlite"
    older_database_file(db, "4", ("cache_held",))
    store = ResultsStore.__new__(ResultsStore)
    store.path, store.read_only, store.conn = db, False, sqlite3.connect(db)

    def fail_after_first_step():
        raise RuntimeError("killed")

    steps = {"4": store._migrate_from_4, "5": fail_after_first_step}
    with pytest.raises(RuntimeError):
        store._migrate("4", steps)
    store.conn.close()
    conn = sqlite3.connect(db)
    version = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()[0]
    columns = [row[1] for row in conn.execute("PRAGMA table_info(records)")]
    conn.close()
    assert version == "4" and "cache_held" not in columns  # rolled back whole
    ResultsStore(db).close()  # and a later open migrates it


def test_api_refuses_token_ids_outside_the_vocabulary(tmp_path):
    from draftlab import SpeculativeDecoder
    from tests.conftest import tiny_model_dir

    decoder = SpeculativeDecoder.from_names(str(tiny_model_dir(tmp_path / "tiny")), drafter="ngram", k=2, dtype="fp32")
    for ids in ([1, 2, 64], [-1, 2], [1.5, 2], [2**40]):
        with pytest.raises(DraftlabError):
            decoder.generate(ids, max_new_tokens=4)
    assert decoder.generate([1, 2, 3], max_new_tokens=4).token_ids


def test_skip_past_the_end_and_duplicate_ids_are_refused(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a", "id": "x"}\n{"prompt": "b", "id": "y"}\n')
    assert len(load_prompts(str(path), skip=1)) == 1
    with pytest.raises(DraftlabError, match="leaves none"):
        load_prompts(str(path), skip=2)
    path.write_text('{"prompt": "a", "id": "x"}\n{"prompt": "b", "id": "x"}\n')
    with pytest.raises(DraftlabError, match="twice"):
        load_prompts(str(path))
    assert os.path.exists(path)


@pytest.mark.slow
def test_a_mode_that_is_not_exact_says_rounding_wherever_it_reports(tmp_path, capsys):
    from draftlab.cli import main
    from tests.conftest import tiny_model_dir

    model = str(tiny_model_dir(tmp_path / "tiny"))
    base = ["generate", "--target", model, "--prompt", "w1 w2 w3", "--no-chat", "--max-new-tokens", "4"]
    for extra in (["--numerics", "fp32 linear"], ["--numerics", "fp32 weight-major"], ["--backend", "hf"]):
        assert main([*base, *extra]) == 0
        assert "up to rounding" in capsys.readouterr().out
    assert main([*base, "--numerics", "fp32 exact-wm/4"]) == 0
    assert "rounding" not in capsys.readouterr().out
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "w1 w2 w3", "id": "a"}\n{"prompt": "w4 w5", "id": "b"}\n')
    study = ["study", "--out", str(tmp_path / "s"), "--targets", model, "--drafters", "ngram", "--ks", "1",
             "--methods", "sps", "--datasets", str(prompts), "--limit", "2", "--max-new-tokens", "6",
             "--warmup", "0", "--no-progress", "--dtype", "fp32", "--no-host-baselines", "--backend", "hf"]
    assert main(study) == 0
    out = capsys.readouterr().out
    assert "lossless only up to rounding" in out and "transformers' forward" in out


def test_a_ggufs_tensor_types_come_from_its_header_as_gguf_reads_them_and_a_bad_file_is_one_line(tmp_path):
    """The header reader (lengths skipped, no metadata parsed) finds the tensor types `gguf.GGUFReader` finds, on the
    shipped GGUF and on a derived pure Q4_0; a file that is not GGUF, or is cut short, is one clear line."""
    from gguf import GGUFReader

    from draftlab.backends.gguf import tensor_types
    from draftlab.models import gguf_path

    for name in ("smollm2-135m", "smollm2-135m@Q4_0_PURE"):
        path = gguf_path(name)
        assert tensor_types(path) == frozenset(t.tensor_type.name for t in GGUFReader(path).tensors)
    (tmp_path / "text.gguf").write_text("not a model")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(gguf_path("smollm2-135m").read_bytes()[:200_000])  # inside the vocabulary's strings
    for bad in (tmp_path / "text.gguf", cut):
        with pytest.raises(DraftlabError, match=f"cannot read the tensors of GGUF {bad}"):
            tensor_types(bad)
