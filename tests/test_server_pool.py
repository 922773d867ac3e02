"""The study's server pool: a server start that would not fit in the host's memory is refused with one line, judged
by what the largest running server of its kind holds; servers are real processes (a tiny HTTP server that answers
`/health`), the host's free memory is what the test says it is."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest

from draftlab.contenders import server_configs
from draftlab.contenders.served import ServedProcess, ServedRun, available_gib
from draftlab.errors import DraftlabError

HEALTHY = """
import http.server, sys
port = int(sys.argv[sys.argv.index('--port') + 1])
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(('127.0.0.1', port), Health).serve_forever()
"""


@dataclass
class TinyServer(ServedProcess):
    NAME: ClassVar[str] = "tiny"
    START_TIMEOUT_S: ClassVar[float] = 30.0

    def start(self) -> None:
        self.launch([sys.executable, "-c", HEALTHY], {})

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait()

    def contender(self, context_length: int, reuse: bool = True, share=None) -> ServedRun:
        return ServedRun(self, context_length, reuse, share)


@dataclass(frozen=True)
class TinyConfig:
    name: str

    def server(self, log_dir: Path) -> TinyServer:
        return TinyServer(self, log_dir)

    def prefill_group(self) -> str:
        return ""


def test_a_server_that_would_not_fit_is_refused_with_one_line(tmp_path, monkeypatch):
    pool = server_configs.ServerPool(tmp_path, most_in_flight=4)
    try:
        first = pool.contender(TinyConfig("a"))
        held = first.server.memory_gib()
        assert 0 < held < available_gib()  # a real process's share of memory, counted from /proc
        # the first of a kind always starts; the next one fits where the host has what the first holds, and more
        monkeypatch.setattr(server_configs, "available_gib", lambda: held + server_configs.MEMORY_MARGIN_GIB + 1)
        pool.contender(TinyConfig("b"))
        monkeypatch.setattr(server_configs, "available_gib", lambda: held + server_configs.MEMORY_MARGIN_GIB / 2)
        with pytest.raises(DraftlabError, match=r"no room for another tiny server: .* GiB of memory left, one holds "
                                                r".* GiB here and 2 run; fewer drafters, K values or concurrency"):
            pool.contender(TinyConfig("c"))
        assert len(pool.running) == 2
        pool.contender(TinyConfig("a"))  # a running configuration is no new start
    finally:
        servers = [server for server, _ in pool.running.values()]
        pool.stop_all()
    assert all(server.process.poll() is not None for server in servers)
    assert all(server.memory_gib() == 0 for server in servers)


def test_a_server_not_held_is_stopped_to_make_room_the_one_used_last_first(tmp_path, monkeypatch):
    """Where the host holds two servers: the two the work in progress holds are kept (the third is refused); once
    let go, a third stops the one used last of those not held again, and a stopped one starts again when used."""
    pool = server_configs.ServerPool(tmp_path)
    # the host the test makes: 1 GiB given back by each server stopped, less than the margin once two run
    monkeypatch.setattr(server_configs, "available_gib",
                        lambda: server_configs.MEMORY_MARGIN_GIB + (2 - len(pool.running)) - 0.001)
    try:
        a, b = pool.contender(TinyConfig("a")), pool.contender(TinyConfig("b"))
        with pytest.raises(server_configs.NoRoom, match="no room for another tiny server"):
            pool.contender(TinyConfig("c"))
        pool.let_go()
        pool.contender(TinyConfig("a"))  # held again; b is not
        pool.contender(TinyConfig("c"))
        assert b.server.process.poll() is not None and a.server.process.poll() is None
        assert [config.name for config in pool.running] == ["a", "c"] and pool.stopped_for_room == 1
        pool.let_go()
        again = pool.contender(TinyConfig("b"))  # c was used last: it goes, a stays
        assert [config.name for config in pool.running] == ["a", "b"] and again.server.process.poll() is None
    finally:
        pool.stop_all()


def test_contenders_come_in_groups_that_fit_each_measured_before_the_next_starts(tmp_path, monkeypatch):
    """Five configurations on a host that holds two servers: groups of two, two and one, each group's servers
    running while it is measured; a configuration that cannot start at all fails alone; a second pass (the next
    prompt) starts all five again."""
    pool = server_configs.ServerPool(tmp_path)
    monkeypatch.setattr(server_configs, "available_gib",
                        lambda: server_configs.MEMORY_MARGIN_GIB + (2 - len(pool.running)) - 0.001)
    failed = []

    def make(name: str):
        if name == "broken":
            raise DraftlabError("broken on purpose")
        return pool.contender(TinyConfig(name))

    try:
        groups = []
        for group in server_configs.in_groups(["a", "b", "broken", "c", "d", "e"], make, pool,
                                              lambda name, exc: failed.append(name)):
            assert all(run.server.process.poll() is None for run in group.values())
            groups.append(list(group))
        assert groups == [["a", "b"], ["c", "d"], ["e"]] and failed == ["broken"]
        assert not pool.held and pool.stopped_for_room == 3 and (pool.starts, pool.most_running) == (5, 2)
        # the next prompt's groups start every one again (what a study's plan prices: `budget._restarts_s`)
        assert [list(g) for g in server_configs.in_groups(["a", "b", "c", "d", "e"], make, pool, print)] == groups
        assert pool.starts == 10
    finally:
        pool.stop_all()
