"""Hostile and malformed requests to the reference server (issue 37): each input that once gave an unhandled 500,
froze the server or was accepted unchecked now gets a 4xx naming the field (or, for sampling that can keep no
token, the greedy answer, by the same rule on both APIs); after each, the server answers /health and gives
bit-identical greedy outputs. One real server process for the module (a subprocess: a slow stop regex must not
share the test's interpreter)."""
from __future__ import annotations

import json
import threading
import time

import pytest
import requests

from conformance.server.golden import PROMPTS
from tests.server.reference_process import assert_healthy_and_unchanged, reference_server_with_baseline

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def server():
    with reference_server_with_baseline() as (proc, _model, client, baseline):
        yield proc.url, client, baseline


def _post(url: str, path: str, body) -> requests.Response:
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return requests.post(url + path, data=data, headers={"content-type": "application/json"}, timeout=60)


def _deep(depth: int) -> str:
    return "[" * depth + "]" * depth


HOSTILE = [  # (id, path, body, status, what the message must name)
    ("lone-surrogate-native", "/generate", '{"text": "\\ud800", "sampling_params": {"max_new_tokens": 2}}', 400,
     "text: not valid Unicode text"),
    ("lone-surrogate-openai", "/v1/completions", '{"prompt": "a\\udfff", "max_tokens": 2}', 400,
     "prompt: not valid Unicode text"),
    ("lone-surrogate-stop", "/v1/completions", '{"prompt": "a", "max_tokens": 2, "stop": ["\\ud800"]}', 400,
     "stop[0]: not valid Unicode text"),
    ("nested-100000-completions", "/v1/completions", '{"prompt": ' + _deep(100_000) + "}", 400, "nested deeper"),
    ("nested-100000-rpc", "/collective_rpc", '{"method": "reload_weights", "kwargs": ' + _deep(100_000) + "}", 400,
     "nested deeper"),
    ("nested-40-generate", "/generate", '{"text": "a", "x": ' + _deep(40) + "}", 400, "nested deeper than 32"),
    ("rpc-kwargs-list-of-dicts", "/collective_rpc", {"method": "reload_weights", "kwargs": [{}]}, 400,
     "kwargs must be a JSON object"),
    ("rpc-kwargs-int", "/collective_rpc", {"method": "reload_weights", "kwargs": 7}, 400, "kwargs must be a JSON object"),
    ("rpc-kwargs-strings", "/collective_rpc", {"method": "reload_weights", "kwargs": ["weights_path"]}, 400,
     "kwargs must be a JSON object"),
    ("rpc-args-object", "/collective_rpc", {"method": "reload_weights", "args": {"a": 1}}, 400, "args must be a JSON array"),
    ("token-ids-logprob-20k", "/generate", {"text": "a", "return_logprob": True, "token_ids_logprob": list(range(20_000)),
                                           "sampling_params": {"max_new_tokens": 8}}, 400,
     "token_ids_logprob: at most 256 token ids"),
    ("rid-count-mismatch", "/generate", {"text": ["a", "b"], "rid": ["x"], "sampling_params": {"max_new_tokens": 8}},
     400, "1 rid for 2 prompts"),
    ("array-over-limit", "/generate", {"input_ids": [1] * 70_000}, 400, "input_ids: an array of 70000 items"),
]


@pytest.mark.parametrize("case", HOSTILE, ids=[c[0] for c in HOSTILE])
def test_hostile_request_is_a_4xx_naming_the_field(server, case):
    url, client, baseline = server
    _id, path, body, status, named = case
    r = _post(url, path, body)
    assert r.status_code == status, (r.status_code, r.text[:300])
    assert named in r.text, r.text[:300]
    assert_healthy_and_unchanged(url, client, baseline)


@pytest.mark.parametrize("api,body", [
    ("openai", {"temperature": 1e-308}), ("openai", {"temperature": 5e-324}), ("openai", {"top_p": 5e-324}),
    ("native", {"temperature": 5e-324}), ("native", {"top_p": 5e-324}),
], ids=["openai-temperature-1e-308", "openai-temperature-5e-324", "openai-top-p-5e-324", "native-temperature-5e-324",
        "native-top-p-5e-324"])
def test_sampling_that_can_keep_no_token_is_greedy_on_both_apis(server, api, body):
    """A temperature below SGLang's 1e-6 is greedy, and top_p always keeps the most likely token, on both APIs:
    the answer is the greedy one."""
    url, client, baseline = server
    if api == "openai":
        r = _post(url, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 8, "ignore_eos": True,
                                           "return_token_ids": True, "seed": 3, **body})
        ids = r.json()["choices"][0]["token_ids"] if r.status_code == 200 else None
    else:
        r = _post(url, "/generate", {"text": PROMPTS[0], "sampling_params": {"max_new_tokens": 8, "ignore_eos": True,
                                                                             "temperature": 1.0, "sampling_seed": 3,
                                                                             **body}})
        ids = r.json()["output_ids"] if r.status_code == 200 else None
    assert r.status_code == 200, r.text[:300]
    assert tuple(ids) == baseline[0].ids
    assert_healthy_and_unchanged(url, client, baseline)


def test_chunked_body_over_the_limit_is_refused_on_the_bytes_read(server):
    """16 MiB sent chunked (no Content-Length): 413 once 1 MiB has been read, the connection closed."""
    url, client, baseline = server

    def chunks():
        piece = b" " * (1 << 16)
        yield b'{"text": "'
        for _ in range(256):
            yield piece
        yield b'"}'

    r = requests.post(url + "/generate", data=chunks(), headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 413 and "request body over" in r.text, (r.status_code, r.text[:200])
    assert r.headers.get("connection", "").lower() == "close"
    assert_healthy_and_unchanged(url, client, baseline)


@pytest.mark.parametrize("pattern,refused", [
    ("^([\\w ]+)+Z", False),  # issue 37's freeze under `re` (each token x80); the `regex` module matches it fast
    ("(.*){1,32000}[QX]", True),  # one that still backtracks (no Q or X in the text): the 1 s budget ends it
], ids=["nested-quantifier", "still-backtracking"])
def test_catastrophic_stop_regex_never_delays_health(server, pattern, refused):
    """A stop regex with catastrophic backtracking never delays /health by 1 s: it is searched off the event
    loop with the GIL released, and a search that outlives the request's 1 s budget fails that request with a
    400 naming the pattern."""
    url, client, baseline = server
    latencies: list[float] = []
    done = threading.Event()

    def poll():
        while not done.is_set():
            t = time.monotonic()
            requests.get(url + "/health", timeout=10)
            latencies.append(time.monotonic() - t)
            time.sleep(0.05)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    try:
        r = _post(url, "/generate", {"text": "people of the north and", "sampling_params": {
            "max_new_tokens": 24, "ignore_eos": True, "stop_regex": pattern}})
    finally:
        done.set()
        poller.join(timeout=15)
    if refused:
        assert r.status_code == 400 and "stop_regex" in r.text and "took over 1 s" in r.text, (r.status_code, r.text[:300])
    else:
        assert r.status_code == 200, (r.status_code, r.text[:300])
    assert latencies and max(latencies) < 1.0, f"/health took up to {max(latencies):.2f} s meanwhile"
    assert_healthy_and_unchanged(url, client, baseline)


def test_an_unhandled_error_is_a_500_that_closes_the_connection():
    """The last resort for a bug: a 500 naming the exception type, with `Connection: close` (the server ends
    the connection after it: issue 37 saw 500s drop keep-alive connections without saying so)."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from reference_impl.server.guard import RequestGuard, internal_error

    app = FastAPI()

    @app.post("/v1/boom")
    async def boom():
        raise RuntimeError("a bug")

    app.add_middleware(RequestGuard, max_bytes=1024)
    app.add_exception_handler(Exception, internal_error)
    r = TestClient(app, raise_server_exceptions=False).post("/v1/boom", json={"a": 1})
    assert r.status_code == 500 and r.headers.get("connection") == "close", (r.status_code, dict(r.headers))
    assert r.json()["error"]["message"].startswith("internal error (RuntimeError)")
