"""The results store refuses what is not a study database and never overwrites it."""

from __future__ import annotations

import sqlite3

import pytest

from draftlab.errors import DraftlabError
from draftlab.study.store import Cell, Record, ResultsStore

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
    assert store.environments() == [{"torch": "x"}]
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
