"""The server scenarios' verdicts do not depend on timing (issue 39).

* Time limits come from the server's own pace (conformance/interfaces/server_pace.py): a slow server that always
  answers passes, one that loses a request fails with "request lost", a hung or stalled one says so. Shown on
  the :class:`Pace` alone with scripted requests and probes (each verdict, in seconds), and on stand-in servers
  (tests/server/mutants.py: ``slow_3x``, ``slows_down``, ``drops_one_request``).
* batch_size_invariance compares what it chooses (explicit batches), not what the scheduler happened to do:
  stand-ins that co-batch concurrent requests at random get the same verdict in 10 runs out of 10 --
  ``random_cobatching`` (batch invariant) passes, ``random_cobatching_batch_variant`` fails at the explicit
  batch, ``cobatch_variant_only`` (variant only in co-batched forwards) fails when it promises invariance and
  passes against the truth when it does not.
"""
from __future__ import annotations

import re
import threading
import time

import pytest

from conformance.interfaces.server_pace import (MARGIN, STALL_FACTOR, Calibration, Pace, ProbeResult, RequestLost,
                                                ServerHung, ServerStalled)
from conformance.server.dialects import make_dialect
from conformance.server.launcher import ServerProcess
from conformance.server.models import ModelCatalog
from conformance.server.scenarios import SCENARIOS_BY_ID, calibrate, fresh_outputs, run_scenario
from tests.server.test_server_mutants import TEMPLATE

CAL = Calibration(generate_s=0.02, probe_s=0.01, control_s=0.05, probe_prompt="p")


# ----------------------------------------------------------------------------------------- the pace alone
def _sleeper(seconds: float, value="done"):
    def send():
        time.sleep(seconds)
        return value
    return send


def test_an_answer_within_the_limit_is_returned_without_probing():
    pace = Pace(CAL, floor_s=0.5)
    assert pace.run(_sleeper(0.05), "POST /x", "generate", lambda _l: pytest.fail("probed")) == "done"
    assert pace.probes == 0


def test_a_slow_server_is_waited_for_at_the_speed_its_probe_shows():
    """The request takes 8x its limit; the probe is 100x slower than calibrated: slow, not lost."""
    pace = Pace(CAL, floor_s=0.1)
    probe = lambda _limit: ProbeResult(True, CAL.probe_s * 100)  # noqa: E731
    assert pace.run(_sleeper(0.8), "POST /x", "generate", probe) == "done"
    assert pace.probes >= 1 and pace.slowest == pytest.approx(100)


def test_a_request_the_server_does_not_serve_is_lost():
    """The server answers its probes at calibrated speed; the request never comes back."""
    never = threading.Event()
    pace = Pace(CAL, floor_s=0.2)
    start = time.monotonic()
    with pytest.raises(RequestLost, match=r"POST /x: request lost: no answer after .* served a 1-token probe"):
        pace.run(lambda: never.wait(30), "POST /x", "generate", lambda _l: ProbeResult(True, CAL.probe_s))
    assert time.monotonic() - start < 2.0  # judged at its limit, not at some fixed timeout
    never.set()


def test_a_server_that_stops_answering_health_is_hung():
    never = threading.Event()
    with pytest.raises(ServerHung, match=r"stopped answering its health endpoint \(.*3 probes in a row"):
        Pace(CAL, floor_s=0.1).run(lambda: never.wait(30), "POST /x", "generate",
                                   lambda _l: ProbeResult(False, None, "/health did not answer"))
    never.set()


def test_a_server_that_completes_nothing_is_stalled_after_stall_factor_limits():
    never = threading.Event()
    pace = Pace(CAL, floor_s=0.05)
    start = time.monotonic()
    with pytest.raises(ServerStalled, match="server stalled: it answers its health endpoint but completed no"):
        pace.run(lambda: never.wait(30), "POST /x", "generate", lambda _l: ProbeResult(True, None, "probe timed out"))
    assert time.monotonic() - start >= STALL_FACTOR * 0.05
    never.set()


def test_limits_scale_with_requests_in_flight_and_the_measured_slowdown():
    pace = Pace(CAL, floor_s=0.0)
    assert pace.limit("generate", 1) == pytest.approx(MARGIN * CAL.generate_s)
    assert pace.limit("generate", 8) == pytest.approx(8 * MARGIN * CAL.generate_s)
    assert pace.limit("generate", 2, slowdown=3.0) == pytest.approx(6 * MARGIN * CAL.generate_s)
    assert pace.limit("control", 5) == pytest.approx(MARGIN * CAL.control_s)
    assert Pace(CAL).limit("generate", 1) >= 10.0  # the floor


def test_the_requests_own_error_is_raised():
    def send():
        raise AssertionError("POST /x answered 500")
    with pytest.raises(AssertionError, match="answered 500"):
        Pace(CAL).run(send, "POST /x", "generate", lambda _l: pytest.fail("probed"))


# ----------------------------------------------------------------------------------------- stand-in servers
@pytest.fixture(scope="module")
def catalog():
    return ModelCatalog([], None, [], None)


@pytest.fixture
def standin(catalog):
    """``start(mutant, floor_s=None)`` -> (paced sglang client, model, truths, fresh outputs); stopped after."""
    started: list[ServerProcess] = []

    def start(mutant: str, floor_s: float | None = None):
        model = catalog.served("dense-nvfp4_awq")
        server = ServerProcess(TEMPLATE, 240.0, mutant=mutant, model_path=model.a, tokenizer_path=model.tokenizer,
                               tp=1)
        started.append(server)
        first = make_dialect("sglang", server.url, max_request_s=120.0)
        fresh = fresh_outputs(first)
        pace = calibrate(first, time.monotonic() - server.started_at)
        if floor_s is not None:
            pace.floor_s = floor_s
        truths = {s: catalog.truth(model, s) for s in ("a", "b")}
        return first.with_deadline(None, pace), model, truths, fresh

    yield start
    for server in started:
        server.stop()


def _verdicts(client, model, truths, fresh, runs: int, batch_invariant: bool) -> list[str]:
    out = []
    for _ in range(runs):
        try:
            run_scenario(SCENARIOS_BY_ID["batch_size_invariance"], client, model, truths, fresh=fresh,
                         batch_invariant=batch_invariant)
            out.append("passed")
        except AssertionError as exc:  # the check that failed (round numbers and gauge readings vary by run)
            check = re.match(r"batch_size_invariance \((alone vs [a-z ]+)", str(exc))
            out.append(f"failed: {check.group(1) if check else str(exc)[:200]}")
    return out


pytestmark = pytest.mark.integration


@pytest.mark.parametrize("mutant,batch_invariant,verdict", [
    ("random_cobatching", True, "passed"),
    ("random_cobatching_batch_variant", True, "failed: alone vs one batched request"),
    ("cobatch_variant_only", True, "failed: alone vs concurrent"),
    ("cobatch_variant_only", False, "passed"),
])
def test_batch_invariance_verdict_is_the_same_in_10_runs(standin, mutant, batch_invariant, verdict):
    client, model, truths, fresh = standin(mutant)
    verdicts = _verdicts(client, model, truths, fresh, 10, batch_invariant)
    assert len(set(verdicts)) == 1, f"{mutant}: verdicts differ between runs: {verdicts}"
    assert verdicts[0] == verdict, verdicts


@pytest.mark.parametrize("mutant,floor_s", [("slow_3x", None), ("slows_down", 0.5)])
def test_a_slow_server_that_always_answers_passes(standin, mutant, floor_s):
    client, model, truths, fresh = standin(mutant, floor_s)
    run_scenario(SCENARIOS_BY_ID["repeated_requests_deterministic"], client, model, truths, fresh=fresh)
    if mutant == "slows_down":  # its requests outlived their calibrated limits: the probes measured why
        assert client.pace.probes >= 1 and client.pace.slowest > 10


def test_a_server_that_drops_a_request_fails_with_request_lost(standin):
    client, model, truths, fresh = standin("drops_one_request", floor_s=1.0)
    with pytest.raises(RequestLost, match="request lost"):
        run_scenario(SCENARIOS_BY_ID["repeated_requests_deterministic"], client, model, truths, fresh=fresh)
