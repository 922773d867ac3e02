"""The results store refuses what is not a study database and never overwrites it."""

from __future__ import annotations

import sqlite3

import pytest

from draftlab.errors import DraftlabError
from draftlab.study.run.store import SCHEMA_VERSION, Cell, Record, ResultsStore
from tests.conftest import older_database_file

CELL = Cell("t", "ngram", 2, "sps", "d", 0.0, 16)


def test_round_trip(tmp_path):
    store = ResultsStore(tmp_path / "s.sqlite")
    run = store.start_run({"torch": "x"})
    store.add(Record(CELL, "p1", "code", 16, 8, 16, 8, [1, 1], [2, 2], wall_s=1.0, output_sha="abc"), run)
    store.close()
    store = ResultsStore(tmp_path / "s.sqlite")
    assert store.done() == {(CELL.key, "p1")}
    (row,) = store.rows()
    assert row["accepted_per_step"] == [1, 1] and row["k"] == 2 and row["category"] == "code"
    assert store.environments() == [{"torch": "x", "run_id": 1}]
    with pytest.raises(sqlite3.IntegrityError):
        store.add(Record(CELL, "p1", "code", 1, 1, 0, 0), run)


def test_garbage_file_is_refused_and_untouched(tmp_path):
    path = tmp_path / "results.sqlite"
    path.write_bytes(b"definitely not sqlite" * 100)
    before = path.read_bytes()
    with pytest.raises(DraftlabError, match="not a"):
        ResultsStore(path)
    assert path.read_bytes() == before


def test_foreign_database_is_refused(tmp_path):
    path = tmp_path / "other.sqlite"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE meta (key TEXT, value TEXT)")
    conn.execute("INSERT INTO meta VALUES ('app', 'something-else')")
    conn.commit()
    conn.close()
    with pytest.raises(DraftlabError, match="not a draftlab study database"):
        ResultsStore(path)
    other = tmp_path / "plain.sqlite"
    conn = sqlite3.connect(other)
    conn.execute("CREATE TABLE users (name TEXT)")
    conn.commit()
    conn.close()
    with pytest.raises(DraftlabError, match="not a draftlab study database"):
        ResultsStore(other)


V1_SCHEMA = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE models (name TEXT PRIMARY KEY, params INTEGER);
CREATE TABLE runs (run_id INTEGER PRIMARY KEY AUTOINCREMENT, started_at TEXT, environment TEXT);
CREATE TABLE records (
    cell TEXT NOT NULL, prompt_id TEXT NOT NULL,
    target TEXT, drafter TEXT, k INTEGER, method TEXT, dataset TEXT, temperature REAL, max_new_tokens INTEGER,
    category TEXT, run_id INTEGER, new_tokens INTEGER, steps INTEGER, drafted INTEGER, accepted INTEGER,
    accepted_per_step TEXT, drafted_per_step TEXT,
    prefill_s REAL, draft_s REAL, target_s REAL, overhead_s REAL, wall_s REAL,
    output_sha TEXT, identical INTEGER, created_at TEXT,
    PRIMARY KEY (cell, prompt_id)
);
"""


def test_version_1_database_is_migrated_with_its_settings_in_the_key(tmp_path):
    path = tmp_path / "v1.sqlite"
    conn = sqlite3.connect(path)
    conn.executescript(V1_SCHEMA)
    conn.executemany("INSERT INTO meta VALUES (?, ?)",
                     [("app", "draftlab-study"), ("schema_version", "1"), ("config", '{"seed": 3, "skip": 2}')])
    conn.execute("INSERT INTO runs VALUES (1, 'then', ?)",
                 ('{"dtype": "float32", "device": "cpu", "backend": "auto"}',))
    conn.execute("INSERT INTO records VALUES ('old-key', 'p1', 't', 'ngram', 2, 'sps', 'd', 0.0, 16, 'code', 1, "
                 "16, 8, 16, 8, '[1]', '[2]', 0, 0, 0, 0, 1.0, 'abc', 1, 'then')")
    conn.commit()
    conn.close()
    store = ResultsStore(path)
    migrated = Cell("t", "ngram", 2, "sps", "d", 0.0, 16, seed=3, dtype="fp32", backend="auto", device="cpu", skip=2)
    assert store.done() == {(migrated.key, "p1")}
    assert store.get_meta("schema_version") == SCHEMA_VERSION
    run = store.start_run({})
    bf16 = Cell("t", "ngram", 2, "sps", "d", 0.0, 16, seed=3, dtype="bf16", skip=2)
    store.add(Record(bf16, "p1", "code", 16, 8, 16, 8), run)
    assert {r["dtype"] for r in store.rows()} == {"fp32", "bf16"}


def test_newer_schema_is_refused_untouched(tmp_path):
    path = tmp_path / "new.sqlite"
    ResultsStore(path).close()
    conn = sqlite3.connect(path)
    conn.execute("UPDATE meta SET value = '99' WHERE key = 'schema_version'")
    conn.commit()
    conn.close()
    before = path.read_bytes()
    with pytest.raises(DraftlabError, match="upgrade draftlab"):
        ResultsStore(path)
    assert path.read_bytes() == before


def test_every_setting_that_changes_a_record_is_in_the_cell_key(tmp_path):
    from dataclasses import replace

    from draftlab.models import resolve_dtype_name
    from draftlab.study.run.sweep import SweepConfig
    from tests.conftest import tiny_model_dir

    fp32 = SweepConfig(dtype="fp32", host_baselines=False)
    base = fp32.cells("t", "d", 0.0)[-1]
    for change in ({"seed": 1}, {"dtype": "bf16"}, {"backend": "hf"}, {"skip": 4}, {"max_new_tokens": 9}):
        other = replace(fp32, **change).cells("t", "d", 0.0)[-1]
        assert other.key != base.key, change
    tiny = str(tiny_model_dir(tmp_path / "tiny"))  # 'auto' is timed on a model's shapes
    resolved = SweepConfig(dtype=resolve_dtype_name("auto", "cpu", tiny)).cells(tiny, "d", 0.0)[0].key
    assert SweepConfig(dtype="auto").cells(tiny, "d", 0.0)[0].key == resolved  # the key holds the resolved dtype


def older_database(path, record: Record, version: str, dropped: tuple[str, ...]) -> ResultsStore:
    """A database holding `record` made into what an older draftlab wrote (`dropped` columns gone), reopened."""
    older_database_file(path, version, dropped, record)
    return ResultsStore(path)


def test_version_3_database_gains_tree_levels_and_keeps_its_records(tmp_path):
    cell = Cell("t", "ngram", 2, "sps", "d", 0.0, 16)  # a version-3 file, as draftlab 0.3.0 wrote them
    store = older_database(tmp_path / "v3.sqlite", Record(cell, "p1", "code", 16, 8, 16, 8, [1] * 8, [2] * 8), "3",
                           ("levels_per_step", "cache_held"))
    assert store.get_meta("schema_version") == SCHEMA_VERSION
    (row,) = store.rows()
    assert row["levels_per_step"] == [] and row["drafted_per_step"] == [2] * 8
    tree = Cell("t", "tree:2:ngram", 2, "sps", "d", 0.0, 16)
    store.add(Record(tree, "p1", "code", 16, 8, 24, 8, [1] * 8, [3] * 8, levels_per_step=[[2, 1]] * 8), 1)
    assert store.rows()[1]["levels_per_step"] == [[2, 1]] * 8


def test_version_4_database_gains_the_cache_column(tmp_path):
    cell = Cell("t", "ngram", 2, "sps", "d", 0.0, 16)  # a version-4 file, as draftlab 0.9.0 wrote them
    store = older_database(tmp_path / "v4.sqlite", Record(cell, "p1", "code", 16, 8, 16, 8), "4", ("cache_held",))
    assert store.get_meta("schema_version") == SCHEMA_VERSION and store.rows()[0]["cache_held"] is None
    store.add(Record(Cell("t", "suffix", 8, "sps", "d", 0.0, 16), "p1", "code", 16, 8, 16, 8, cache_held=3), 1)
    assert store.rows()[1]["cache_held"] == 3
