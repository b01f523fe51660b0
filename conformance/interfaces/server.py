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
import time
from dataclasses import dataclass
from typing import ClassVar, Sequence
from urllib.parse import urlparse

import requests

from conformance.interfaces.server_pace import HTTP_CEILING_S, Pace, ProbeResult
from conformance.interfaces.server_types import LOCAL_HOSTS, Deadline, Generation, TokenGeneration

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


#: the calibration batch (4 prompts of at least 5 tokens, 8 generated) in the units of :func:`request_work`
CALIBRATION_WORK = 4 * (5 + 8) ** 2


def request_work(prompts: Sequence[Sequence[int]], new_tokens: int) -> float:
    """A token-id request's cost in calibration batches, for its pace: the sum over sequences of the squared
    final length (a server without a KV cache recomputes each prefix: quadratic; with one, attention still
    grows with the length), at least 1. Only when a request has waited this many calibrated times is the
    server probed, so an overestimate merely delays a 'request lost' verdict."""
    return max(1.0, sum((len(p) + new_tokens) ** 2 for p in prompts) / CALIBRATION_WORK)


class ServerDialect(abc.ABC):
    """One engine API. Every HTTP call is bounded by the scenario's ``deadline`` (when there is one) and by either
    the server's :class:`~conformance.interfaces.server_pace.Pace` (limits derived from its calibration, a slow
    server told from a lost request by probing it: set by :meth:`with_deadline`) or, without one, a fixed
    ``max_request_s``."""

    name: ClassVar[str]
    #: operation -> why this API cannot do it (operations: reload_weights, release_memory, resume_memory,
    #: flush_cache); scenarios needing one of them skip with the reason
    unsupported: ClassVar[dict[str, str]] = {}
    #: environment variables a server launched for this API needs (set unless the environment has them)
    launch_env: ClassVar[dict[str, str]] = {}
    #: the paths that generate (paced by the calibration batch); every other call is a control operation
    #: (reload, memory), paced by the server's start-up time
    generate_paths: ClassVar[tuple[str, ...]] = ()
    #: Prometheus gauges (on ``/metrics``) counting the requests the server is running now; the scenarios
    #: read them to report whether concurrent requests were co-batched (never to judge)
    running_gauges: ClassVar[tuple[str, ...]] = ()
    pace: Pace | None = None

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

    def with_deadline(self, deadline: Deadline | None, pace: Pace | None = None) -> "ServerDialect":
        """A new client of the same server bounded by ``deadline`` (None: no scenario ceiling) and paced by
        ``pace`` (None: this client's pace, if any)."""
        client = type(self)(self.base_url, deadline, self.max_request_s)
        client.pace = pace if pace is not None else self.pace
        return client

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

    def generate_ids(self, prompts: Sequence[Sequence[int]], spec: SamplingSpec,
                     prompt_logprobs: bool = True) -> list[TokenGeneration]:
        """One HTTP request for all token-id ``prompts`` (a batch of exactly these token counts: the workload
        scenarios choose the engine's forward sizes); with ``prompt_logprobs`` every prompt token after the
        first is scored too (the prefill's outputs). Dialects that cannot send token ids or return prompt
        logprobs raise :class:`DialectUnsupported` for ``generate_ids`` / ``prompt_logprobs``."""
        raise self._unsupported("generate_ids")

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

    def running_requests(self) -> int | None:
        """How many requests the server runs right now, from its ``/metrics`` (None: it reports no such gauge).
        Not paced: a 2 s limit, any failure is None."""
        if not self.running_gauges:
            return None
        try:
            r = self._http.get(self.base_url + "/metrics", timeout=2.0)
        except requests.RequestException:
            return None
        if r.status_code != 200:
            return None
        values: dict[str, float] = {}  # gauge -> its sum over label sets
        for line in r.text.splitlines():
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in self.running_gauges:
                try:
                    values[name] = values.get(name, 0.0) + float(line.rsplit(None, 1)[-1])
                except ValueError:
                    return None
        first = next((g for g in self.running_gauges if g in values), None)  # the first one the server has
        return None if first is None else int(values[first])

    # ------------------------------------------------------------------ HTTP
    def _unsupported(self, operation: str) -> DialectUnsupported:
        return DialectUnsupported(self.name, operation, self.unsupported.get(operation, "no endpoint for it"))

    def _timeout(self) -> float:
        ceiling = HTTP_CEILING_S if self.pace is not None else self.max_request_s
        left = self.deadline.remaining() if self.deadline else ceiling
        return max(0.1, min(left, ceiling))

    def probe(self, limit_s: float) -> ProbeResult:
        """Is the server alive and serving? Its health endpoint, then one 1-token greedy request of the
        calibration's probe prompt, timed (each bounded by ``limit_s``, not paced: a probe never probes)."""
        client = type(self)(self.base_url, None, limit_s)
        try:
            if not client.healthy():
                return ProbeResult(False, None, f"{self.health_path} did not answer 200 within 2 s")
            start = time.monotonic()
            try:
                client.generate([self.pace.calibration.probe_prompt if self.pace else "probe"], SamplingSpec(1))
            except (AssertionError, DialectUnsupported) as exc:
                return ProbeResult(True, None, f"a 1-token probe request did not complete: {str(exc)[:200]}")
            return ProbeResult(True, time.monotonic() - start)
        finally:
            client.close()

    #: Methods retried once on a fresh connection when the pooled one turns out to be closed (RFC 9110 idempotent).
    IDEMPOTENT = frozenset({"GET", "HEAD", "OPTIONS", "PUT", "DELETE"})

    def _call(self, method: str, path: str, **kwargs) -> requests.Response:
        """One HTTP request, paced when the client has a pace (see the class docstring). Connections are pooled
        (see :meth:`_send`)."""
        work = kwargs.pop("work", 1.0)  # the request's cost in calibration batches (request_work)
        if self.pace is None:
            return self._send(method, path, **kwargs)
        kind = "generate" if path in self.generate_paths else "control"
        return self.pace.run(lambda: self._send(method, path, **kwargs), f"{method} {path}", kind, self.probe, work)

    def _send(self, method: str, path: str, **kwargs) -> requests.Response:
        """One HTTP request. Connections are pooled (keep-alive), but never reused after an answer the server
        may close the connection behind (a 5xx, or ``Connection: close``): vLLM answers a failed
        ``/collective_rpc`` with 500 and closes that connection, and the next request sent on it would fail
        with a connection reset instead of reaching the server. An idempotent request whose pooled connection
        fails before any answer is retried once on a fresh connection."""
        for attempt in (1, 2):
            timeout = self._timeout()
            try:
                r = self._http.request(method, self.base_url + path, timeout=timeout, **kwargs)
            except requests.Timeout as exc:
                raise AssertionError(f"{method} {path} timed out after {timeout:.0f} s (a fixed limit, no "
                                     f"calibrated pace: request lost, server hung or too slow)") from exc
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
