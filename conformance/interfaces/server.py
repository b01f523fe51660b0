"""The server interface: the HTTP API the scenario suite speaks to an engine (like httpx's ``BaseTransport``).

:class:`ServerDialect` holds the operations the scenarios need, in engine-neutral terms; each engine API is a
plain subclass (the built-in ones, SGLang's native API, the OpenAI-compatible API and vLLM's, are in
:mod:`conformance.server.dialects`), selected with ``--server-api`` or ``$NVFP4_CONFORMANCE_SERVER_API``. An
operation a dialect lacks raises :class:`DialectUnsupported` carrying the reason, so a scenario that needs it
skips with that reason (``unsupported`` lists them up front). A server that answers wrongly raises
``AssertionError`` naming the endpoint and the answer.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import ClassVar, Sequence
from urllib.parse import urlparse

import requests

from conformance.interfaces.server_types import LOCAL_HOSTS, Deadline, Generation

MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")  # SGLang's names; each dialect maps them


class DialectUnsupported(Exception):
    """The dialect has no endpoint for ``operation``; ``reason`` says why (skip the scenario with it)."""

    def __init__(self, dialect: str, operation: str, reason: str):
        super().__init__(f"the {dialect} API cannot {operation}: {reason}")
        self.dialect, self.operation, self.reason = dialect, operation, reason


@dataclass(frozen=True)
class SamplingSpec:
    """What a scenario asks of a generation. ``temperature`` 0 is greedy; ``seed`` makes sampling repeatable."""

    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = True


@dataclass(frozen=True)
class ReloadResult:
    success: bool
    message: str


class ServerDialect(abc.ABC):
    """One engine API. Every HTTP call is bounded by ``max_request_s`` and the scenario's ``deadline``."""

    name: ClassVar[str]
    #: operation -> why this API cannot do it (operations: reload_weights, release_memory, resume_memory,
    #: flush_cache); scenarios needing one of them skip with the reason
    unsupported: ClassVar[dict[str, str]] = {}
    #: environment variables a server launched for this API needs (set unless the environment has them)
    launch_env: ClassVar[dict[str, str]] = {}

    @classmethod
    def missing(cls, operations: Sequence[str]) -> dict[str, str]:
        """Those of ``operations`` this API lacks, each with the reason."""
        return {op: cls.unsupported[op] for op in operations if op in cls.unsupported}

    def __init__(self, base_url: str, deadline: Deadline | None = None, max_request_s: float = 60.0):
        if urlparse(base_url).hostname not in LOCAL_HOSTS:
            raise ValueError(f"server scenarios only talk to a local server (127.0.0.1), got {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self.deadline, self.max_request_s = deadline, max_request_s
        self._http = self._new_session()

    @staticmethod
    def _new_session() -> requests.Session:
        session = requests.Session()
        session.trust_env = False  # never through a proxy: the server is local
        return session

    def with_deadline(self, deadline: Deadline) -> "ServerDialect":
        return type(self)(self.base_url, deadline, self.max_request_s)

    def close(self) -> None:
        self._http.close()

    # ------------------------------------------------------------------ operations
    def healthy(self) -> bool:
        """The server answers its health endpoint (no deadline: used while waiting for start-up)."""
        try:
            return self._http.get(self.base_url + self.health_path, timeout=2.0).status_code == 200
        except requests.RequestException:
            return False

    health_path: ClassVar[str] = "/health"

    @abc.abstractmethod
    def model_path(self) -> str:
        """The checkpoint the server serves (where the API reports it)."""

    @abc.abstractmethod
    def generate(self, prompts: Sequence[str], spec: SamplingSpec) -> list[Generation]:
        """One HTTP request for all ``prompts`` (a batch); per prompt the text, token ids and per-token logprobs."""

    def reload_weights(self, path: str, flush_cache: bool = True) -> ReloadResult:
        """Load the checkpoint at ``path`` into the running server; a failure is ``success=False`` + why."""
        raise self._unsupported("reload_weights")

    def release_memory(self, tags: Sequence[str] | None = None) -> None:
        """Release GPU memory (``tags`` from :data:`MEMORY_TAGS`; all when None). Released weights lose
        their contents: reload them after resuming."""
        raise self._unsupported("release_memory")

    def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        raise self._unsupported("resume_memory")

    def flush_cache(self) -> None:
        raise self._unsupported("flush_cache")

    def restore_serving(self) -> None:
        """Best effort, after a scenario failed half-way: leave the server generating again (nothing released,
        nothing paused), so one failure does not turn every later scenario on the same server into a failure
        for the wrong reason. Errors are swallowed: the failure being reported is the scenario's. The default
        resumes all memory where the dialect can; dialects with more state (a pause) add to it."""
        try:
            self.resume_memory(None)
        except (AssertionError, DialectUnsupported, ValueError):
            pass

    # ------------------------------------------------------------------ HTTP
    def _unsupported(self, operation: str) -> DialectUnsupported:
        return DialectUnsupported(self.name, operation, self.unsupported.get(operation, "no endpoint for it"))

    def _timeout(self) -> float:
        left = self.deadline.remaining() if self.deadline else self.max_request_s
        return max(0.1, min(left, self.max_request_s))

    #: Methods retried once on a fresh connection when the pooled one turns out to be closed (RFC 9110 idempotent).
    IDEMPOTENT = frozenset({"GET", "HEAD", "OPTIONS", "PUT", "DELETE"})

    def _call(self, method: str, path: str, **kwargs) -> requests.Response:
        """One HTTP request. Connections are pooled (keep-alive), but never reused after an answer the server
        may close the connection behind (a 5xx, or ``Connection: close``): vLLM answers a failed
        ``/collective_rpc`` with 500 and closes that connection, and the next request sent on it would fail
        with a connection reset instead of reaching the server. An idempotent request whose pooled connection
        fails before any answer is retried once on a fresh connection."""
        for attempt in (1, 2):
            try:
                r = self._http.request(method, self.base_url + path, timeout=self._timeout(), **kwargs)
            except requests.Timeout as exc:
                raise AssertionError(f"{method} {path} timed out (request lost or server hung)") from exc
            except requests.ConnectionError as exc:
                self._reset_connections()
                if attempt == 1 and method.upper() in self.IDEMPOTENT:
                    continue
                raise AssertionError(f"{method} {path}: connection failed (server gone?): {exc}") from exc
            if r.status_code >= 500 or r.headers.get("connection", "").lower() == "close":
                self._reset_connections()
            return r
        raise AssertionError("unreachable")

    def _reset_connections(self) -> None:
        """Drop every pooled connection: the next request opens a new one."""
        self._http.close()
        self._http = self._new_session()

    def _json(self, r: requests.Response, what: str) -> object:
        try:
            return r.json()
        except ValueError as exc:
            raise AssertionError(f"{what} answered {r.status_code} without JSON: {r.text[:200]}") from exc

    def _ok(self, r: requests.Response, what: str) -> requests.Response:
        if r.status_code != 200:
            raise AssertionError(f"{what} answered {r.status_code}: {r.text[:300]}")
        return r
