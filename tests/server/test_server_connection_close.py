"""A server that answers a failed weight reload with 500 and closes that keep-alive connection (what vLLM does
after a failed ``/collective_rpc``): the dialects never send the next request on the closed connection, so the
failed-reload scenarios reach their real check (the old weights keep serving) through every dialect that can
reload. A control run with connection reuse forced back on shows the stand-in reproduces the reset.

The stand-in is a small HTTP/1.1 proxy in front of the in-process reference server: it forwards every request;
an error answer of a weight endpoint goes out as 500, and the connection it went out on is then reset (RST)
as soon as the client sends its next request on it -- the worst timing, where the client cannot have seen
the close before reusing the connection."""
from __future__ import annotations

import http.server
import select
import socket
import struct
import threading

import pytest
import requests

from conformance.interfaces.server import ServerDialect
from conformance.server.dialects import DIALECTS, make_dialect
from conformance.server.models import ModelCatalog
from conformance.server.scenarios import SCENARIOS_BY_ID, fresh_outputs, run_scenario
from tests.server.live_reference_server import live_reference_server

pytestmark = pytest.mark.integration  # starts servers or whole pytest runs (ci/time_tests.py times them apart)

WEIGHT_PATHS = ("/collective_rpc", "/update_weights_from_disk")
FAILED_RELOADS = ("failed_reload_missing_path", "failed_reload_corrupt_checkpoint")
RELOADING = sorted(name for name, cls in DIALECTS.items() if not cls.missing(("reload_weights",)))


class _ClosingProxy(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, backend: str):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.backend, self.closed_after_500 = backend, 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as uvicorn and vLLM speak it
    server: _ClosingProxy

    def log_message(self, *args) -> None:  # quiet
        pass

    def _forward(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        headers = {k: v for k, v in self.headers.items() if k.lower() in ("content-type", "accept")}
        r = requests.request(self.command, self.server.backend + self.path, data=body, headers=headers, timeout=60)
        status = r.status_code
        failed_weight_call = self.path.split("?")[0] in WEIGHT_PATHS and status >= 400
        if failed_weight_call:
            status = 500
        self.send_response(status)
        self.send_header("Content-Type", r.headers.get("content-type", "application/json"))
        self.send_header("Content-Length", str(len(r.content)))
        self.end_headers()  # no "Connection: close": the client cannot know
        self.wfile.write(r.content)
        self.wfile.flush()
        if failed_weight_call:
            # wait for the client's next request on this connection (or give up after 5 s), then reset it
            select.select([self.connection], [], [], 5.0)
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.close_connection = True
            self.server.closed_after_500 += 1

    do_GET = do_POST = _forward


@pytest.fixture(scope="module")
def proxy():
    catalog = ModelCatalog([], None, [], None)
    model = catalog.served("dense-nvfp4_awq")
    with live_reference_server(model.a) as (backend, _engine):
        server = _ClosingProxy(backend)
        thread = threading.Thread(target=server.serve_forever, name="closing-proxy", daemon=True)
        thread.start()
        try:
            truths = {s: catalog.truth(model, s) for s in ("a", "b")}
            yield server, model, truths
        finally:
            server.shutdown()
            server.server_close()


def _run(proxy, scenario_id: str, api: str):
    server, model, truths = proxy
    client = make_dialect(api, server.url)
    fresh = fresh_outputs(client)
    before = server.closed_after_500
    try:
        result = run_scenario(SCENARIOS_BY_ID[scenario_id], client, model, truths, timeout_s=120, fresh=fresh)
    finally:
        client.close()
    return result, server.closed_after_500 - before


@pytest.mark.parametrize("api", RELOADING)
@pytest.mark.parametrize("scenario_id", FAILED_RELOADS)
def test_failed_reload_reaches_its_check_after_a_500_that_closes(proxy, scenario_id: str, api: str) -> None:
    result, closes = _run(proxy, scenario_id, api)
    assert closes >= 1, "the stand-in never answered 500: the test would not test the dialect"
    assert result.compared > 0  # the old weights' outputs after the failed reload were checked against golden


def test_reusing_the_closed_connection_fails_for_the_wrong_reason(proxy, monkeypatch) -> None:
    """Control: with the connection reuse the dialects used to have, the scenario fails on the reset, not on
    the server's answer: the stand-in reproduces what the fix is for."""
    monkeypatch.setattr(ServerDialect, "_reset_connections", lambda self: None)
    with pytest.raises(AssertionError, match=r"connection failed \(server gone\?\)"):
        _run(proxy, "failed_reload_missing_path", "vllm")


class _ResetOnce:
    """A session whose pooled connection was reset: the first request fails before any answer."""

    calls = 0

    def request(self, method, url, **kwargs):
        type(self).calls += 1
        if type(self).calls == 1:
            raise requests.ConnectionError("Connection reset by peer")
        return requests.Session().request(method, url, **kwargs)

    def close(self):
        pass


@pytest.mark.parametrize("method,retried", [("GET", True), ("POST", False)])
def test_only_idempotent_requests_are_retried_on_a_fresh_connection(proxy, monkeypatch, method, retried) -> None:
    server, _model, _truths = proxy
    client = make_dialect("vllm", server.url)
    _ResetOnce.calls = 0
    client._http = _ResetOnce()
    monkeypatch.setattr(ServerDialect, "_new_session", staticmethod(_ResetOnce))
    if retried:
        assert client._call(method, "/is_sleeping").status_code == 200 and _ResetOnce.calls == 2
    else:
        with pytest.raises(AssertionError, match="connection failed"):
            client._call(method, "/resume")
        assert _ResetOnce.calls == 1
