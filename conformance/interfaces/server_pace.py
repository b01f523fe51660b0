"""Time limits derived from the server under test, and the difference between a slow server and a lost request.

A fixed time limit turns a server that is merely slow (its CPU shared with other work, a big model) into a
failure, and lets a server that drops one request hang a scenario for minutes. Instead, the suite measures the
server once after start-up (:class:`Calibration`: the wall time of one greedy batch, one 1-token probe request
and the start-up itself) and bounds every request from those figures:

* a request may take ``MARGIN x`` its calibrated duration ``x`` the number of requests in flight to the server
  at once (a server that runs them one after another is slow, not wrong), and never less than ``FLOOR_S``;
* when that time has passed the server is probed: ``/health`` and the 1-token probe request, timed. The probe
  measures how much slower the server is *now* than at calibration (the slowdown); the request's limit is
  scaled by it and the wait goes on while it holds. A request still unanswered past its scaled limit, while the
  server answers its probes, is **lost** (a conformance failure, "request lost"). A server that answers
  ``/health`` but completes no probe either keeps its requests for up to ``STALL_FACTOR`` limits, then is
  **stalled** (a failure: no progress); one that does not answer ``/health`` to ``HUNG_PROBES`` probes in a
  row is **hung or gone**.

Why these constants (the false-failure risk of each verdict):

* ``FLOOR_S = 10``: no request is judged before 10 s, far above the jitter of a loaded machine (scheduler
  quanta, page faults, a garbage-collector pause: milliseconds to a few hundred ms), so a sub-second calibration
  cannot make a hair trigger.
* ``MARGIN = 5``: the calibration batch is the largest batch the scenarios send but for the 2x explicit batch of
  batch_size_invariance (a factor 2), and one timed request on a loaded machine is up to ~2.5x the idle median
  (``benchmarks/bench_pace.py`` on the 2-core CI machine, reference server, 20 calibrations each: greedy batch
  idle 0.056-0.064 s, median 0.058 s; beside 2 busy-loop processes 0.074-0.145 s): 2 x 2.5 = 5. Beyond that
  the probe measures the slowdown (never taken below 1: a lucky fast probe cannot tighten a limit; loaded, the
  probe's median was 2.2x its idle one).
* ``STALL_FACTOR = 10``: a server that completes nothing, not even a 1-token probe, for 10 whole limits is
  stuck, not slow: the probe would have measured any slowdown that still lets requests finish.

An engine slower than its calibration by any factor therefore passes as long as it keeps answering; only a
request that the server demonstrably does not serve fails. A user ceiling (``--server-timeout``) still bounds a
whole scenario when given.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable, TypeVar

FLOOR_S = 10.0
MARGIN = 5.0
STALL_FACTOR = 10.0
HUNG_PROBES = 3  # health probes failed in a row, one limit apart, before a server is called hung
HTTP_CEILING_S = 3600.0  # the HTTP timeout under pacing: the pace decides long before it

T = TypeVar("T")


@dataclass(frozen=True)
class Calibration:
    """Measured after start-up: ``generate_s`` one greedy calibration batch, ``probe_s`` one 1-token request
    (its prompt ``probe_prompt``), ``control_s`` the server's start-up (bounds reloads and memory commands)."""

    generate_s: float
    probe_s: float
    control_s: float
    probe_prompt: str

    def describe(self) -> str:
        return (f"calibration: greedy batch {self.generate_s:.2f} s, probe {self.probe_s:.2f} s, "
                f"start-up {self.control_s:.1f} s")


@dataclass(frozen=True)
class ProbeResult:
    healthy: bool  # answered its health endpoint
    probe_s: float | None  # the 1-token probe request's wall time; None: it did not complete (or was refused)
    note: str = ""


class RequestLost(AssertionError):
    """The server answers probes but did not serve this request within its scaled limit."""


class ServerStalled(AssertionError):
    """The server answers ``/health`` but completes no request at all."""


class ServerHung(AssertionError):
    """The server does not answer ``/health``."""


class Pace:
    """One server's calibration, shared by every dialect talking to it (thread-safe: the concurrent scenarios
    send from several threads). Counts the requests in flight and waits for each as described above."""

    def __init__(self, calibration: Calibration, floor_s: float = FLOOR_S):
        """``floor_s``: the shortest limit (the self-tests lower it to exercise probing in seconds)."""
        self.calibration, self.floor_s = calibration, floor_s
        self._lock = threading.Lock()
        self._in_flight = 0
        self.slowest = 1.0  # the largest slowdown any probe measured (reported with the scenario's results)
        self.probes = 0

    def limit(self, kind: str, in_flight: int, slowdown: float = 1.0, work: float = 1.0) -> float:
        """Seconds a request of ``kind`` ('generate' or 'control') may take before the server is probed."""
        c = self.calibration
        base = c.generate_s * work * max(1, in_flight) if kind == "generate" else c.control_s
        return max(self.floor_s, MARGIN * base * max(1.0, slowdown))

    def run(self, send: Callable[[], T], what: str, kind: str, probe: Callable[[float], ProbeResult],
            work: float = 1.0) -> T:
        """``send()`` in a worker thread, waited for by the rules above; its result (or its exception)."""
        with self._lock:
            self._in_flight += 1
            peak = self._in_flight
        start = time.monotonic()
        done, box = _in_thread(send, f"paced {what}")
        try:
            self._wait(done, start, peak, what, kind, probe, work)
        finally:
            with self._lock:
                self._in_flight -= 1
        if "error" in box:
            raise box["error"]  # type: ignore[misc]
        return box["value"]  # type: ignore[return-value]

    def _wait(self, done: threading.Event, start: float, peak: int, what: str, kind: str,
              probe: Callable[[float], ProbeResult], work: float) -> None:
        """Wait until ``done`` (a request sent at ``start``, ``peak`` in flight then), probing the server at each
        limit; raises ServerHung, ServerStalled or RequestLost as described above."""
        slowdown, stalled_since, unhealthy = 1.0, None, 0
        while True:
            with self._lock:
                peak = max(peak, self._in_flight)
            limit = self.limit(kind, peak, slowdown, work)
            if done.wait(max(0.0, start + limit - time.monotonic())):
                break
            result = probe(STALL_FACTOR * self.limit("generate", peak))  # the probe may be slow too
            self.probes += 1
            if result.probe_s is not None:
                new = max(1.0, result.probe_s / max(self.calibration.probe_s, 1e-3))
                self.slowest = max(self.slowest, new)
                slowdown = max(slowdown, new)
            if done.is_set():
                break
            waited = time.monotonic() - start
            unhealthy = 0 if result.healthy else unhealthy + 1
            if unhealthy >= HUNG_PROBES:
                raise ServerHung(f"{what}: the server stopped answering its health endpoint ({result.note}; "
                                 f"{HUNG_PROBES} probes in a row); the request had waited {waited:.1f} s "
                                 f"({self.calibration.describe()})")
            if result.probe_s is None:  # alive but nothing completes (or not answering): slow or stuck
                stalled_since = stalled_since or (start + limit)
                if time.monotonic() - stalled_since > STALL_FACTOR * limit:
                    raise ServerStalled(
                        f"{what}: server stalled: it answers its health endpoint but completed no request, "
                        f"not even a 1-token probe, for {time.monotonic() - stalled_since:.0f} s "
                        f"({result.note}); the request had waited {waited:.0f} s "
                        f"({self.calibration.describe()})")
                if done.wait(limit):  # probe again after another limit
                    break
                continue
            stalled_since = None
            if waited < self.limit(kind, peak, slowdown, work):
                continue  # slow, not lost: wait on at the slowest speed measured
            raise RequestLost(
                f"{what}: request lost: no answer after {waited:.1f} s, while the server answers its health "
                f"endpoint and served a 1-token probe in {result.probe_s:.2f} s (its calibrated "
                f"{self.calibration.probe_s:.2f} s; slowest seen {slowdown:.1f}x): at that speed, with {peak} "
                f"request(s) in flight, it should have answered within {self.limit(kind, peak, slowdown, work):.1f} s "
                f"({self.calibration.describe()})")


def _in_thread(send: Callable[[], T], name: str) -> tuple[threading.Event, dict[str, object]]:
    """Start ``send()`` in a daemon thread; the event is set when it returns, the dict then holds its ``value`` or
    its ``error``."""
    box: dict[str, object] = {}
    done = threading.Event()

    def target() -> None:
        try:
            box["value"] = send()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = exc
        finally:
            done.set()

    threading.Thread(target=target, name=name, daemon=True).start()
    return done, box
