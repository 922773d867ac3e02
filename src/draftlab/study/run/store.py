"""The results store: one SQLite database per study, one row per prompt per cell.

Schema (version 8), readable with `sqlite3` or `pandas.read_sql`:

    meta(key TEXT PRIMARY KEY, value TEXT)
        app = 'draftlab-study', schema_version = '8', config = the sweep's JSON
    models(name TEXT PRIMARY KEY, params INTEGER)
        parameter counts of targets and model drafts ("target" or "target::drafter"),
        for the report's scaling ratio (target params / draft params)
    runs(run_id INTEGER PRIMARY KEY, started_at TEXT, environment TEXT)
        environment: JSON with versions, device, threads, dtype, platform
    records(
        cell TEXT, prompt_id TEXT,             -- primary key: a finished (cell, prompt)
        target, drafter, k, method, dataset, temperature, max_new_tokens,
        seed, dtype, backend, device, skip,    -- every setting that changes a record is in its cell key
        category, run_id, new_tokens, steps, drafted, accepted,
        accepted_per_step TEXT,                -- JSON list, one entry per step
        drafted_per_step TEXT,                 -- JSON list
        prefill_s, draft_s, target_s, overhead_s, wall_s,
        output_sha TEXT,                       -- SHA256 of the generated token ids
        identical INTEGER,                     -- 1/0 vs its own engine's plain decoding on the same prompt
                                               -- ('ar' for sps and hf, 'hf' for asg); NULL if unknown
        created_at TEXT,
        finished_at REAL,                      -- Unix time the measurement ended (NULL in migrated records)
        levels_per_step TEXT)                  -- JSON list of lists: drafted tokens per tree level, each step;
                                               -- '[]' when every step drafted a chain (then a step's depth
                                               -- is its drafted count)
        cache_held INTEGER)                    -- earlier responses the drafter's cross-request cache held when
                                               -- the prompt started (suffix decoding: each cell has its own
                                               -- cache, over its prompts in order); NULL for other drafters
        concurrency INTEGER,                   -- requests in flight (1: alone; above 1: llama-server under load)
        window_tokens INTEGER,                 -- under load: new tokens of every request sent with this prompt's
                                               -- (then wall_s is the window's, first request to last answer)
        latency_s REAL)                        -- under load: the window's mean seconds per request
    baseline_checks(
        target, dataset, temperature, prompt_id, run_id, new_tokens, wall_s,
        finished_at REAL)                      -- the 'ar' cell re-timed on the same prompt between other cells,
                                               -- so each cell is compared with the baseline closest in time
    prefills(target, engine, dataset, prompt_id, run_id, prompt_tokens,
             seconds, finished_at)             -- each engine's prefill of a prompt, timed apart: its cells decode
                                               -- from it (their prefill_s is it, their wall_s it plus the decode)
    skips(cell TEXT, prompt_id TEXT,           -- primary key: a (cell, prompt) that was not measured, and why:
          run_id INTEGER, reason TEXT,         -- a peer that cannot run the prompt, or a cell dropped by the race
          created_at TEXT)                     -- (it trailed the best by more than the machine's noise)

`method` is 'ar' (our autoregressive loop), 'sps' (our speculative engine), 'asg' (Hugging Face assisted
generation), 'hf' (Hugging Face `generate` without an assistant: AsG's own plain decoding, run whenever asg cells are), 'lcp' (llama-cpp-python's prompt lookup)
and 'llama' (its plain `generate`), 'server' (llama-server's own speculative type, `drafter`, with its draft
length flag `k`, 0 for the server's default) and 'server-ar' (the same server's plain decoding), or 'plain' (our
plain decoding in another mode: a dtype and route, or llama.cpp's default kernels). `dtype` is resolved ('fp32', not 'auto'; 'gguf' on llama.cpp). Older databases are migrated in place when opened: version 1 (whose cell key
lacked seed, dtype, backend, device and skip) gets those settings from the run's recorded environment and the
stored sweep config; version 2 gets the `finished_at` column and the `baseline_checks` table; version 3 gets `levels_per_step`; version 4 `cache_held`;
version 5 the `skips` table; version 6 `concurrency` (1 for every older record), `window_tokens` and `latency_s`;
version 7 the `prefills` table (empty: its records each prefilled within their wall time).
A migration runs in one transaction (a kill leaves the old version whole). Each record is committed on its own,
so a killed sweep loses at most the record in flight; resuming skips every (cell, prompt) already present.
"""

from __future__ import annotations

import fcntl
import json
import sqlite3
import time
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator

from draftlab.errors import DraftlabError
from draftlab.study.run.cells import Cell, Record  # noqa: F401  (re-exported: the store's row types)

APP = "draftlab-study"
SCHEMA_VERSION = "8"
LEFT_OUT = "left_out"  # meta key: the lines of the engines the last sweep left out (draftlab.contenders.preflight), JSON
SETTINGS = ("seed", "dtype", "backend", "device", "skip")
RECORD_COLUMNS = (
    "cell", "prompt_id", "target", "drafter", "k", "method", "dataset", "temperature", "max_new_tokens", *SETTINGS,
    "category", "run_id", "new_tokens", "steps", "drafted", "accepted", "accepted_per_step", "drafted_per_step",
    "prefill_s", "draft_s", "target_s", "overhead_s", "wall_s", "output_sha", "identical", "created_at", "finished_at",
    "levels_per_step", "cache_held", "concurrency", "window_tokens", "latency_s",
)

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS models (name TEXT PRIMARY KEY, params INTEGER);
CREATE TABLE IF NOT EXISTS runs (run_id INTEGER PRIMARY KEY AUTOINCREMENT, started_at TEXT, environment TEXT);
CREATE TABLE IF NOT EXISTS records (
    cell TEXT NOT NULL, prompt_id TEXT NOT NULL,
    target TEXT, drafter TEXT, k INTEGER, method TEXT, dataset TEXT, temperature REAL, max_new_tokens INTEGER,
    seed INTEGER, dtype TEXT, backend TEXT, device TEXT, skip INTEGER,
    category TEXT, run_id INTEGER, new_tokens INTEGER, steps INTEGER, drafted INTEGER, accepted INTEGER,
    accepted_per_step TEXT, drafted_per_step TEXT,
    prefill_s REAL, draft_s REAL, target_s REAL, overhead_s REAL, wall_s REAL,
    output_sha TEXT, identical INTEGER, created_at TEXT, finished_at REAL, levels_per_step TEXT, cache_held INTEGER,
    concurrency INTEGER DEFAULT 1, window_tokens INTEGER, latency_s REAL,
    PRIMARY KEY (cell, prompt_id)
);
"""

SKIPS_SCHEMA = """
CREATE TABLE IF NOT EXISTS skips (
    cell TEXT NOT NULL, prompt_id TEXT NOT NULL, run_id INTEGER, reason TEXT NOT NULL, created_at TEXT,
    PRIMARY KEY (cell, prompt_id)
);
"""

CHECKS_SCHEMA = """
CREATE TABLE IF NOT EXISTS baseline_checks (
    target TEXT, dataset TEXT, temperature REAL, prompt_id TEXT, run_id INTEGER,
    new_tokens INTEGER, wall_s REAL, finished_at REAL
);
"""


PREFILLS_SCHEMA = """
CREATE TABLE IF NOT EXISTS prefills (
    target TEXT, engine TEXT, dataset TEXT, prompt_id TEXT, run_id INTEGER, prompt_tokens INTEGER, seconds REAL,
    finished_at REAL
);
"""


class ResultsStore:
    """A study database; refuses files that are not draftlab study databases."""

    def __init__(self, path: str | Path, read_only: bool = False) -> None:
        """`read_only` (report, export): the file is never written; an older schema is migrated in a copy held in
        memory, so that reading a study does not change it."""
        self.path = Path(path)
        self.read_only = read_only
        existed = self.path.exists() and self.path.stat().st_size > 0
        if read_only and not existed:
            raise DraftlabError(f"study database not found: {self.path}")
        if not existed:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self.conn = self._connect()
        try:
            self._check() if existed else self._create()
        except DraftlabError:
            self.conn.close()
            raise
        if not read_only:
            self._use_wal()

    @contextmanager
    def writing(self) -> Iterator[None]:
        """This process is the database's only writer for the block (a lock file beside it): a second sweep on the
        same file is refused with one line instead of failing later on a duplicate record."""
        with open(self.path.with_name(self.path.name + ".lock"), "a") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise DraftlabError(f"another sweep is writing {self.path}; wait for it to finish or give another "
                                    "--db") from None
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def _connect(self) -> sqlite3.Connection:
        try:
            return sqlite3.connect(self.path)
        except sqlite3.DatabaseError as exc:
            raise DraftlabError(f"{self.path} is not a SQLite database ({exc}); give a new file name") from exc

    def _use_wal(self) -> None:
        """Write-ahead logging, switched on only once the file is known to be ours (it rewrites the header)."""
        self.conn.execute("PRAGMA journal_mode=WAL")

    def _create(self) -> None:
        with self.conn:
            self.conn.executescript(SCHEMA + CHECKS_SCHEMA + SKIPS_SCHEMA + PREFILLS_SCHEMA)
            self.conn.executemany(
                "INSERT INTO meta VALUES (?, ?)", [("app", APP), ("schema_version", SCHEMA_VERSION)]
            )

    def _check(self) -> None:
        try:
            meta = dict(self.conn.execute("SELECT key, value FROM meta").fetchall())
            problem = self.conn.execute("PRAGMA quick_check").fetchone()[0]
        except sqlite3.DatabaseError as exc:
            raise DraftlabError(
                f"{self.path} is not a draftlab study database ({exc}); it was left untouched, give a new file name"
            ) from exc
        if meta.get("app") != APP:
            raise DraftlabError(f"{self.path} is not a draftlab study database; it was left untouched")
        if problem != "ok":
            raise DraftlabError(f"{self.path} is corrupted ({problem}); restore it or start a new study file")
        version = meta.get("schema_version")
        if version == SCHEMA_VERSION:
            return
        steps = {"1": lambda: self._migrate_from_1(json.loads(meta.get("config") or "{}")), "2": self._migrate_from_2,
                 "3": self._migrate_from_3, "4": self._migrate_from_4, "5": self._migrate_from_5, "6": self._migrate_from_6,
                 "7": self._migrate_from_7}
        if version not in steps:
            raise DraftlabError(
                f"{self.path} has schema version {version}, this draftlab reads {SCHEMA_VERSION} (and migrates 1-7); "
                "upgrade draftlab to read it; the file was left untouched"
            )
        if self.read_only:  # migrate a copy in memory: the file stays as it is
            memory = sqlite3.connect(":memory:")
            self.conn.backup(memory)
            self.conn.close()
            self.conn = memory
        self._migrate(version, steps)

    def _migrate(self, version: str, steps: dict) -> None:
        """Every step from `version` to the current one in a single transaction: sqlite3 would commit each ALTER
        TABLE by itself, so a kill between two steps could leave a half-migrated file that no later open reads."""
        self.conn.isolation_level = None  # explicit BEGIN/COMMIT; DDL joins the transaction
        try:
            self.conn.execute("BEGIN IMMEDIATE")
            while version != SCHEMA_VERSION:
                steps[version]()
                version = str(int(version) + 1)
            self.conn.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", (SCHEMA_VERSION,))
            self.conn.execute("COMMIT")
        except BaseException:
            self.conn.execute("ROLLBACK")
            raise
        finally:
            self.conn.isolation_level = ""

    def _migrate_from_1(self, config: dict) -> None:
        """Add the settings columns, fill them from each run's environment and the sweep config, re-key."""
        environments = dict(self.conn.execute("SELECT run_id, environment FROM runs").fetchall())
        rows = self.conn.execute("SELECT rowid, run_id, target, drafter, k, method, dataset, temperature, "
                                 "max_new_tokens FROM records").fetchall()
        for column, kind in zip(SETTINGS, ("INTEGER", "TEXT", "TEXT", "TEXT", "INTEGER")):
            self.conn.execute(f"ALTER TABLE records ADD COLUMN {column} {kind}")
        for rowid, run_id, *head in rows:
            env = json.loads(environments.get(run_id) or "{}")
            cell = Cell(*head, seed=int(config.get("seed", 0)), dtype=_short_dtype(env.get("dtype", "fp32")),
                        backend=env.get("backend", "auto"), device=env.get("device", "cpu"),
                        skip=int(config.get("skip", 0)))
            self.conn.execute("UPDATE records SET cell = ?, seed = ?, dtype = ?, backend = ?, device = ?, skip = ? "
                              "WHERE rowid = ?", (cell.key, *(getattr(cell, c) for c in SETTINGS), rowid))

    def _migrate_from_2(self) -> None:
        """Add the records' finish time (unknown for old records) and the baseline re-checks table."""
        self.conn.execute("ALTER TABLE records ADD COLUMN finished_at REAL")
        self.conn.execute(CHECKS_SCHEMA)

    def _migrate_from_3(self) -> None:
        """Add the drafted tokens per tree level (unknown, so '[]': chains, for old records)."""
        self.conn.execute("ALTER TABLE records ADD COLUMN levels_per_step TEXT")

    def _migrate_from_4(self) -> None:
        """Add the responses a drafter's cross-request cache held (NULL: no such drafter before version 5)."""
        self.conn.execute("ALTER TABLE records ADD COLUMN cache_held INTEGER")

    def _migrate_from_5(self) -> None:
        """Add the table of (cell, prompt) pairs that were not measured, with the reason."""
        self.conn.execute(SKIPS_SCHEMA)

    def _migrate_from_6(self) -> None:
        """Add the load columns: every older record ran alone (concurrency 1, no window)."""
        self.conn.execute("ALTER TABLE records ADD COLUMN concurrency INTEGER DEFAULT 1")
        self.conn.execute("ALTER TABLE records ADD COLUMN window_tokens INTEGER")
        self.conn.execute("ALTER TABLE records ADD COLUMN latency_s REAL")

    def _migrate_from_7(self) -> None:
        """8 adds the prefills timed apart (0.20.0: each engine prefills a prompt once; cells time their decode)."""
        self.conn.execute(PREFILLS_SCHEMA)

    def close(self) -> None:
        """Close the connection."""
        self.conn.close()

    def get_meta(self, key: str) -> str | None:
        """A value from the meta table."""
        row = self.conn.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return row[0] if row else None

    def set_meta(self, key: str, value: str) -> None:
        """Store a value in the meta table."""
        with self.conn:
            self.conn.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (key, value))

    def start_run(self, environment: dict) -> int:
        """Record the environment of this sweep invocation; returns its run id."""
        with self.conn:
            cursor = self.conn.execute(
                "INSERT INTO runs (started_at, environment) VALUES (?, ?)", (_now(), json.dumps(environment))
            )
        return int(cursor.lastrowid)

    def set_params(self, name: str, params: int) -> None:
        """Record a model's parameter count."""
        with self.conn:
            self.conn.execute("INSERT OR REPLACE INTO models VALUES (?, ?)", (name, params))

    def params(self) -> dict[str, int]:
        """Every recorded parameter count."""
        return dict(self.conn.execute("SELECT name, params FROM models").fetchall())

    def done(self) -> set[tuple[str, str]]:
        """Every finished (cell key, prompt id): measured, or skipped with a reason."""
        return set(self.conn.execute("SELECT cell, prompt_id FROM records UNION SELECT cell, prompt_id FROM skips"))

    def add_skip(self, cell: Cell, prompt_id: str, reason: str, run_id: int) -> None:
        """Record that (cell, prompt) was not measured and why (one line), and commit it at once."""
        with self.conn:
            self.conn.execute("INSERT OR REPLACE INTO skips VALUES (?, ?, ?, ?, ?)",
                              (cell.key, prompt_id, run_id, reason.splitlines()[0] if reason else "?", _now()))

    def remove_skips(self, cell_key: str, reason_prefix: str) -> list[str]:
        """Forget the skips of a cell whose reason starts with `reason_prefix`; returns their prompt ids."""
        with self.conn:
            prompts = [p for (p,) in self.conn.execute(
                "SELECT prompt_id FROM skips WHERE cell = ? AND substr(reason, 1, ?) = ?",
                (cell_key, len(reason_prefix), reason_prefix))]
            self.conn.execute("DELETE FROM skips WHERE cell = ? AND substr(reason, 1, ?) = ?",
                              (cell_key, len(reason_prefix), reason_prefix))
        return prompts

    def skips(self) -> list[dict]:
        """Every skipped (cell, prompt) with its reason, oldest first."""
        cursor = self.conn.execute("SELECT * FROM skips ORDER BY rowid")
        names = [d[0] for d in cursor.description]
        return [dict(zip(names, values)) for values in cursor.fetchall()]

    def output_sha(self, cell: Cell, prompt_id: str) -> str | None:
        """The output hash recorded for (cell, prompt), if any."""
        row = self.conn.execute(
            "SELECT output_sha FROM records WHERE cell = ? AND prompt_id = ?", (cell.key, prompt_id)
        ).fetchone()
        return row[0] if row else None

    def add(self, record: Record, run_id: int) -> None:
        """Insert one record and commit it at once."""
        c = record.cell
        row = (
            c.key, record.prompt_id, c.target, c.drafter, c.k, c.method, c.dataset, c.temperature, c.max_new_tokens,
            c.seed, c.dtype, c.backend, c.device, c.skip, record.category, run_id, record.new_tokens, record.steps,
            record.drafted, record.accepted,
            json.dumps(record.accepted_per_step), json.dumps(record.drafted_per_step),
            record.prefill_s, record.draft_s, record.target_s, record.overhead_s, record.wall_s,
            record.output_sha, None if record.identical is None else int(record.identical), _now(), time.time(),
            json.dumps(record.levels_per_step), record.cache_held, c.concurrency, record.window_tokens,
            record.latency_s,
        )
        with self.conn:  # columns named: a migrated table has the settings columns at its end
            self.conn.execute(f"INSERT INTO records ({', '.join(RECORD_COLUMNS)}) VALUES ({', '.join('?' * len(row))})",
                              row)

    def add_baseline_check(self, record: Record, run_id: int) -> None:
        """Store a re-timing of the 'ar' cell on one prompt, taken between other cells."""
        c = record.cell
        with self.conn:
            self.conn.execute("INSERT INTO baseline_checks VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                              (c.target, c.dataset, c.temperature, record.prompt_id, run_id, record.new_tokens,
                               record.wall_s, time.time()))

    def add_prefill(self, target: str, dataset: str, prefill, run_id: int) -> None:
        """Store one prompt's prefill by one engine (`draftlab.measure.PrefillRecord`), timed apart from the
        cells, which decode from it."""
        with self.conn:
            self.conn.execute("INSERT INTO prefills VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                              (target, prefill.key, dataset, prefill.prompt_id, run_id, prefill.prompt_tokens,
                               prefill.seconds, prefill.finished_at))

    def prefills(self) -> list[dict]:
        """Every timed prefill, oldest first."""
        cursor = self.conn.execute("SELECT * FROM prefills ORDER BY rowid")
        return [dict(zip([d[0] for d in cursor.description], values)) for values in cursor.fetchall()]

    def baseline_checks(self) -> list[dict]:
        """Every re-timing of the baseline, oldest first."""
        cursor = self.conn.execute("SELECT * FROM baseline_checks ORDER BY rowid")
        names = [d[0] for d in cursor.description]
        return [dict(zip(names, values)) for values in cursor.fetchall()]

    def rows(self) -> list[dict]:
        """Every record as a dict (JSON lists decoded)."""
        cursor = self.conn.execute("SELECT * FROM records ORDER BY rowid")
        names = [d[0] for d in cursor.description]
        out = []
        for values in cursor.fetchall():
            row = dict(zip(names, values))
            row["accepted_per_step"] = json.loads(row["accepted_per_step"] or "[]")
            row["drafted_per_step"] = json.loads(row["drafted_per_step"] or "[]")
            row["levels_per_step"] = json.loads(row["levels_per_step"] or "[]")
            out.append(row)
        return out

    def environments(self) -> list[dict]:
        """The environment of every sweep invocation (each with its `run_id`)."""
        runs = self.conn.execute("SELECT run_id, environment FROM runs ORDER BY run_id")
        return [{**json.loads(e), "run_id": run} for run, e in runs]


def _short_dtype(name: str) -> str:
    """'float32' -> 'fp32' (environments recorded torch's names)."""
    return {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(name, name)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")
