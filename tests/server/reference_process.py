"""A reference server process (one rank, CPU) with its greedy outputs taken right after start-up, for self-tests that
send it hostile or fuzzed requests and then demand it is still healthy and answers as before
(tests/server/test_server_hostile.py, tests/server/test_server_schema.py)."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import requests

from conformance.server.dialects import make_dialect
from conformance.server.golden import PROMPTS
from conformance.server.launcher import REFERENCE_TEMPLATE, ServerProcess
from conformance.server.models import ModelCatalog
from conformance.server.scenarios import GREEDY_SPEC


@contextmanager
def reference_server_with_baseline(family: str = "dense-nvfp4_awq") -> Iterator[tuple]:
    """Yields (server process, served model, its sglang dialect client, the greedy outputs of PROMPTS at start-up);
    closes the client and stops the server on exit."""
    model = ModelCatalog([], None, [], None).served(family)
    proc = ServerProcess(REFERENCE_TEMPLATE, 120.0, model_path=model.a, tokenizer_path=model.tokenizer, tp=1, dp=1,
                         ep=1, device="cpu")
    try:
        client = make_dialect("sglang", proc.url)
        try:
            yield proc, model, client, client.generate(list(PROMPTS), GREEDY_SPEC)
        finally:
            client.close()
    finally:
        proc.stop()


def assert_healthy_and_unchanged(url: str, client, baseline) -> None:
    """/health answers 200 and the greedy outputs of PROMPTS are bit-identical to ``baseline``."""
    assert requests.get(url + "/health", timeout=5).status_code == 200
    after = client.generate(list(PROMPTS), GREEDY_SPEC)
    assert [(g.ids, g.logprobs) for g in after] == [(g.ids, g.logprobs) for g in baseline], "outputs changed"
