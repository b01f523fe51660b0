"""The reference server's vLLM endpoints (vLLM 0.33.0's dev mode): sleep levels 0, 1 and 2, partial wake-up,
pause / resume, ``/collective_rpc`` ``reload_weights``, ``/reset_prefix_cache``, in vLLM's request and
response shapes.
Expected outputs are the server's own greedy outputs before the operation (or of the other checkpoint)."""
from __future__ import annotations

import threading

import pytest
import requests

from fixtures.make_checkpoints import ensure_checkpoints
from tests.server.live_reference_server import live_reference_server

GREEDY = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
PROMPTS = ["the city of water", "people of the north"]


@pytest.fixture(scope="module")
def root():
    return ensure_checkpoints()


@pytest.fixture(scope="module")
def server(root):
    with live_reference_server(root / "dense-nvfp4_awq-a") as (url, engine):
        http = requests.Session()
        http.trust_env = False
        http.url, http.engine = url, engine
        yield http


def call(server, method: str, path: str, **kwargs) -> requests.Response:
    return server.request(method, server.url + path, timeout=60, **kwargs)


def outputs(server) -> list[list[int]]:
    r = call(server, "POST", "/generate", json={"text": PROMPTS, "sampling_params": GREEDY})
    assert r.status_code == 200, r.text
    return [d["output_ids"] for d in r.json()]


def reload(server, path=None) -> requests.Response:
    return call(server, "POST", "/collective_rpc",
                json={"method": "reload_weights", **({"kwargs": {"weights_path": str(path)}} if path else {})})


def is_sleeping(server) -> bool:
    return call(server, "GET", "/is_sleeping").json()["is_sleeping"]


@pytest.fixture
def baseline(server, root):
    """Greedy outputs of weight set a; the test leaves set a serving and the server awake."""
    before = outputs(server)
    yield before
    call(server, "POST", "/wake_up")
    assert reload(server, root / "dense-nvfp4_awq-a").status_code == 200
    assert outputs(server) == before


def test_sleep_level_1_offloads_and_wake_up_restores(server, baseline):
    r = call(server, "POST", "/sleep", params={"level": 1})
    assert r.status_code == 200 and r.json() == {"status": "sleeping", "level": 1}
    assert is_sleeping(server)
    r = call(server, "POST", "/generate", json={"text": PROMPTS[0], "sampling_params": GREEDY})
    assert r.status_code == 503 and r.json()["error"]["type"] == "ServiceUnavailableError"
    r = call(server, "POST", "/wake_up")
    assert r.json() == {"status": "awake", "tags": None} and not is_sleeping(server)
    assert outputs(server) == baseline  # the weights came back from their CPU copy, no reload


def test_sleep_level_2_discards_weights_until_reloaded(server, root, baseline):
    assert call(server, "POST", "/sleep?level=2").status_code == 200
    r = call(server, "POST", "/wake_up", params={"tags": "weights"})
    assert r.json() == {"status": "sleeping", "tags": ["weights"]} and is_sleeping(server)
    r = reload(server, root / "dense-nvfp4_awq-a")
    assert r.status_code == 200 and r.json() == {"results": [None]}
    r = call(server, "POST", "/wake_up", params={"tags": "kv_cache"})
    assert r.json() == {"status": "awake", "tags": ["kv_cache"]}
    assert outputs(server) == baseline


def test_level_2_wake_without_reload_serves_no_weights(server, baseline):
    call(server, "POST", "/sleep", params={"level": 2})
    call(server, "POST", "/wake_up")
    assert outputs(server) != baseline, "level 2 must discard the weights (vLLM: reload after waking)"


def test_reload_weights(server, root, baseline):
    assert reload(server, root / "dense-nvfp4_awq-b").status_code == 200
    other = outputs(server)
    assert other != baseline
    assert reload(server).status_code == 200 and outputs(server) == other  # no path: the served checkpoint
    r = reload(server, root / "dense-nvfp4_awq-corrupt")
    assert r.status_code == 400 and "missing tensor" in r.json()["error"]["message"]
    assert outputs(server) == other, "a failed reload must leave the old weights serving"


@pytest.mark.parametrize("body, match", [
    ({"method": "load_model"}, "method 'load_model' is not available on the reference server; supported: ['reload_weights']"),
    ({"kwargs": {}}, "Missing 'method'"),
    ({"method": "reload_weights", "args": ["x"]}, "takes kwargs weights_path"),
    ({"method": "reload_weights", "kwargs": {"is_checkpoint_format": False}}, "is_checkpoint_format=true only"),
    ([1, 2], "must be a JSON object"),
])
def test_collective_rpc_refuses(server, body, match):
    r = call(server, "POST", "/collective_rpc", json=body)
    assert r.status_code == 400 and match in r.json()["error"]["message"]


def test_sleep_level_0_pauses_scheduling_only(server, baseline):
    assert call(server, "POST", "/sleep", params={"level": 0, "mode": "wait"}).json()["level"] == 0
    assert is_sleeping(server) and not server.engine.released
    assert call(server, "POST", "/generate", json={"text": PROMPTS[0], "sampling_params": GREEDY}).status_code == 503
    assert call(server, "POST", "/wake_up", params={"tags": "scheduling"}).json() == {"status": "awake",
                                                                                       "tags": ["scheduling"]}
    assert not is_sleeping(server) and outputs(server) == baseline


@pytest.mark.parametrize("mode", ["abort", "wait"])
def test_pause_refuses_new_generation_until_resume(server, baseline, mode):
    assert call(server, "POST", "/pause", params={"mode": mode}).json() == {"status": "paused"}
    assert call(server, "GET", "/is_paused").json() == {"is_paused": True}
    for path, body in (("/generate", {"text": "a", "sampling_params": GREEDY}), ("/v1/completions", {"prompt": "a"})):
        r = call(server, "POST", path, json=body)
        assert r.status_code == 503 and "paused" in r.json()["error"]["message"]
    assert call(server, "POST", "/resume").json() == {"status": "resumed"}
    assert call(server, "GET", "/is_paused").json() == {"is_paused": False} and outputs(server) == baseline


def test_pause_keep_holds_generation_until_resume(server, baseline):
    call(server, "POST", "/pause", params={"mode": "keep"})
    held = []
    thread = threading.Thread(target=lambda: held.append(outputs(server)))
    thread.start()
    thread.join(0.5)
    assert thread.is_alive() and not held, "a request sent while paused in keep mode must wait for /resume"
    call(server, "POST", "/resume")
    thread.join(30)
    assert held == [baseline]


@pytest.mark.parametrize("path, params, match", [
    ("/sleep", {"level": 3}, "level"),
    ("/sleep", {"mode": "later"}, "mode='later'"),
    ("/pause", {"mode": "later"}, "mode='later'"),
    ("/wake_up", {"tags": "cuda_graph"}, "unknown wake_up tags ['cuda_graph']"),
])
def test_sleep_and_wake_refuse(server, path, params, match):
    r = call(server, "POST", path, params=params)
    assert r.status_code == 400 and match in r.text
    assert not is_sleeping(server)


def test_reset_prefix_cache(server):
    r = call(server, "POST", "/reset_prefix_cache", params={"reset_running_requests": "true"})
    assert r.status_code == 200 and r.json() == {"success": True}
