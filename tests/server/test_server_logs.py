"""Server logs: written into the directory the caller names (the suite passes pytest's temporary directory),
quoted when a server fails (at start-up or later) and kept then, removed when a server is stopped without
having failed, so a passing run leaves no file behind. A stand-in server (plain ``http.server``) keeps these
tests to a second each."""
from __future__ import annotations

import sys
import time

import pytest

from conformance.server import launcher
from conformance.server.launcher import ServerProcess, ServerStartError

STAND_IN = """\
import http.server, sys, threading
port, die_after = int(sys.argv[1]), int(sys.argv[2])
print("stand-in server listening on", port, flush=True)
served = []
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"{}")
        served.append(1)
        if die_after and len(served) >= die_after:
            print("stand-in server: deliberate crash", flush=True)
            threading.Thread(target=lambda: (__import__("time").sleep(0.2), __import__("os")._exit(7))).start()
    def log_message(self, *args): pass
http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""


def _template(tmp_path, die_after: int) -> str:
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    return f"{{python}} {script} {{port}} {die_after}"


def test_passing_server_leaves_no_log(tmp_path):
    logs = tmp_path / "logs"
    server = ServerProcess(_template(tmp_path, 0), 30.0, log_dir=logs)
    running = list(logs.iterdir())
    assert len(running) == 1 and running[0].name.startswith(f"nvfp4-server-{server.port}-"), running
    assert server.failure_report() is None  # still running
    server.stop()
    assert list(logs.iterdir()) == []


def test_server_dying_later_is_reported_with_its_log(tmp_path):
    logs = tmp_path / "logs"
    server = ServerProcess(_template(tmp_path, 1), 30.0, log_dir=logs)  # dies after its health check
    deadline = time.monotonic() + 10
    while server.proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    report = server.failure_report()
    assert report is not None and "exited with code 7" in report and "deliberate crash" in report, report
    server.stop()
    kept = list(logs.iterdir())
    assert len(kept) == 1 and "deliberate crash" in kept[0].read_text()  # quoted, and kept for the user


def test_start_up_failure_keeps_and_quotes_its_log(tmp_path):
    logs = tmp_path / "logs"
    template = "{python} -c \"print('cannot serve: no weights'); raise SystemExit(4)\""
    with pytest.raises(ServerStartError, match=r"(?s)exited with code 4 during start-up.*cannot serve: no weights"):
        ServerProcess(template, 30.0, log_dir=logs)
    kept = list(logs.iterdir())
    assert len(kept) == 1 and "cannot serve" in kept[0].read_text()


def test_default_log_dir_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(launcher.LOG_DIR_ENV, str(tmp_path / "named"))
    assert launcher.default_log_dir() == tmp_path / "named"
    monkeypatch.delenv(launcher.LOG_DIR_ENV)
    private = launcher.default_log_dir()
    assert private == launcher.default_log_dir() and private.name.startswith("nvfp4-server-logs-")
