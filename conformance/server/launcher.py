"""Start an engine's server from a command template and always clean it up.

Template placeholders: ``{python}`` (this interpreter), ``{model_path}``, ``{tokenizer_path}`` (the
tokenizer.json the prompts are encoded with), ``{port}``, ``{tp}``, ``{dp}``, ``{ep}``, ``{device}``. The
server runs in its own process group (it may spawn ranks); ``stop`` sends SIGTERM to the group, waits, then
SIGKILL. Its output goes to a log file in ``log_dir`` (the suite passes pytest's temporary directory; default
``$NVFP4_SERVER_LOG_DIR``, else a private temporary directory removed at exit), quoted when start-up fails
(a server process that exits during start-up is reported at once, polled every 0.2 s, not after the start
timeout) and by :meth:`ServerProcess.failure_report` when it dies later; ``stop`` removes the log of a server
that did not fail, so a passing run leaves no file behind. ``api`` names the dialect
(conformance/server/dialects.py) whose health endpoint is polled and whose ``launch_env`` is set (vLLM's
dev-mode endpoints: ``VLLM_SERVER_DEV_MODE=1``; the reference server serves every dialect's endpoints
unconditionally).
"""
from __future__ import annotations

import atexit
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from conformance.server.dialects import DIALECTS, dialect_class, make_dialect

REFERENCE_TEMPLATE = ("{python} -m reference_impl.server --model-path {model_path} --tokenizer-path {tokenizer_path} "
                      "--port {port} --tp {tp} --dp {dp} --ep {ep} --device {device}")
REPO_ROOT = Path(__file__).resolve().parents[2]
LOG_DIR_ENV = "NVFP4_SERVER_LOG_DIR"
_LIVE: set["ServerProcess"] = set()
_PRIVATE_LOG_DIR: list[Path] = []


def default_log_dir() -> Path:
    """``$NVFP4_SERVER_LOG_DIR`` if set, else one private temporary directory per process (removed at exit)."""
    if os.environ.get(LOG_DIR_ENV):
        return Path(os.environ[LOG_DIR_ENV])
    if not _PRIVATE_LOG_DIR:
        _PRIVATE_LOG_DIR.append(Path(tempfile.mkdtemp(prefix="nvfp4-server-logs-")))
    return _PRIVATE_LOG_DIR[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerStartError(RuntimeError):
    pass


#: set (to anything) to keep every server's log, not only a failed one's (counting server starts, debugging)
KEEP_LOGS_ENV = "NVFP4_SERVER_KEEP_LOGS"


class ServerProcess:
    def __init__(self, template: str, start_timeout_s: float = 180.0, env: dict[str, str] | None = None,
                 api: str = "sglang", log_dir: str | Path | None = None, **values):
        """``env``: extra environment variables; a ``PYTHONPATH`` given there goes first on the path.
        ``log_dir``: where the server's log goes (default :func:`default_log_dir`)."""
        if api not in DIALECTS:
            raise ValueError(f"unknown server API {api!r}; known: {sorted(DIALECTS)}")
        self.api = api
        self.port = free_port()
        fields = {"python": shlex.quote(sys.executable), "port": self.port, **values}
        try:
            self.command = template.format(**fields)
        except KeyError as exc:
            raise ServerStartError(f"server command template uses unknown placeholder {exc}; "
                                   f"known: {sorted(fields)}") from exc
        self.url = f"http://127.0.0.1:{self.port}"
        log_dir = Path(log_dir) if log_dir is not None else default_log_dir()
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"nvfp4-server-{self.port}-", suffix=".log",
                                               dir=log_dir, delete=False)
        self.failed = False  # keep the log: it is quoted in a failure
        extra = dict(env or {})
        env = {**dialect_class(api).launch_env, **os.environ}  # the user's environment wins
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [extra.pop("PYTHONPATH", None), str(REPO_ROOT),
                                                          env.get("PYTHONPATH")]))
        env.update(extra)
        self.started_at = time.monotonic()
        self.proc = subprocess.Popen(shlex.split(self.command), stdout=self.log, stderr=subprocess.STDOUT,
                                     cwd=REPO_ROOT, env=env, start_new_session=True)
        _LIVE.add(self)
        self._wait_healthy(start_timeout_s)

    def _wait_healthy(self, timeout_s: float) -> None:
        client = make_dialect(self.api, self.url)
        end = time.monotonic() + timeout_s
        try:
            while time.monotonic() < end:
                if self.proc.poll() is not None:
                    code = self.proc.returncode
                    self.failed = True
                    self.stop(grace_s=2.0)  # ranks it spawned may still be alive
                    raise ServerStartError(f"server exited with code {code} during start-up, "
                                           f"{time.monotonic() - self.started_at:.1f} s after launch\n"
                                           f"command: {self.command}\nlog ({self.log.name}):\n{self.log_tail()}")
                if client.healthy():
                    return
                time.sleep(0.2)
        finally:
            client.close()
        self.failed = True
        self.stop()
        raise ServerStartError(f"server not healthy after {timeout_s:.0f} s\ncommand: {self.command}\n"
                               f"log ({self.log.name}):\n{self.log_tail()}")

    def log_tail(self, chars: int = 3000, traceback_chars: int = 12000) -> str:
        """The end of the log; from the start of its last traceback when that is not too far back."""
        try:
            text = Path(self.log.name).read_text(errors="replace")
        except OSError:
            return "(no log)"
        start = text.rfind("Traceback (most recent call last)")
        if start >= 0 and len(text) - start <= traceback_chars:
            return text[start:]
        return text[-chars:]

    def failure_report(self) -> str | None:
        """When the server process has exited (it must not, while in use): its exit code and log, for the
        failure message of the scenario that met it (the log is then kept); None while it runs."""
        if self.proc.poll() is None:
            return None
        self.failed = True
        return (f"the server process exited with code {self.proc.returncode}\ncommand: {self.command}\n"
                f"log ({self.log.name}):\n{self.log_tail()}")

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM the server's process group, SIGKILL what is left after ``grace_s`` (also when the main
        process has already exited: its ranks may not have). The log is removed unless the server failed."""
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(5)
        _LIVE.discard(self)
        self.log.close()
        if not self.failed and not os.environ.get(KEEP_LOGS_ENV):
            Path(self.log.name).unlink(missing_ok=True)


@atexit.register
def _stop_all() -> None:
    for server in list(_LIVE):
        server.stop(grace_s=3.0)
    for path in _PRIVATE_LOG_DIR:  # logs of failed servers were quoted in their failures
        shutil.rmtree(path, ignore_errors=True)
