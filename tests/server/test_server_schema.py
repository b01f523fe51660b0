"""The reference server fuzzed from its own OpenAPI document (schemathesis, issue 37): no 5xx, every answer's status
code documented and its body matching the documented schema (reference_impl/server/openapi.py), and afterwards
the server answers /health and gives bit-identical greedy outputs.

Two bounded runs (a fixed seed: the same inputs every CI run; pass another with NVFP4_SCHEMATHESIS_SEED to hunt):
every operation but the three that stop generation, with every check; then the state-changing operations (pause,
sleep, release and their inverses), where a 503 from generation is the documented answer, with the schema and
status-code checks, followed by a restore (resume, wake up, reload of the served weights)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from tests.server.reference_process import assert_healthy_and_unchanged, reference_server_with_baseline

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not (Path(sys.executable).parent / "st").is_file(),
                                 reason="schemathesis is not installed (pip install -e '.[test]')")]

STATE_CHANGING = "^/(pause|sleep|release_memory_occupation)$"
SEED = os.environ.get("NVFP4_SCHEMATHESIS_SEED", "1")
EXAMPLES = "30"  # per operation at most; each run also stops after MAX_TIME_S
MAX_TIME_S = "15"  # a generation the fuzzer makes valid may ask for 64 prompts x 256 tokens: bound the run's wall


@pytest.fixture(scope="module")
def server():
    with reference_server_with_baseline() as started:
        yield started


def _schemathesis(cwd: Path, url: str, checks: str, *selection: str) -> subprocess.CompletedProcess:
    """``st run`` in ``cwd`` (it writes its cache, ``.schemathesis/``, there: never into the repository)."""
    cmd = [str(Path(sys.executable).parent / "st"), "run", f"{url}/openapi.json", "--checks", checks,
           "--max-examples", EXAMPLES, "--seed", SEED, "--request-timeout", "60", "--max-time", MAX_TIME_S, *selection]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "NO_COLOR": "1"},
                          cwd=cwd)


def test_fuzzed_requests_get_no_5xx_and_match_the_schema(server, tmp_path):
    proc, _model, client, baseline = server
    r = _schemathesis(tmp_path, proc.url, "not_a_server_error,status_code_conformance,response_schema_conformance,"
                                "content_type_conformance", "--exclude-path-regex", STATE_CHANGING)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    assert "Selected: 19/22" in r.stdout, r.stdout[-3000:]
    assert_healthy_and_unchanged(proc.url, client, baseline)


def test_state_changing_operations_match_the_schema_and_the_server_recovers(server, tmp_path):
    proc, model, client, baseline = server
    r = _schemathesis(tmp_path, proc.url, "status_code_conformance,response_schema_conformance,content_type_conformance",
                      "--include-path-regex", STATE_CHANGING)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    for path in ("/resume", "/wake_up", "/resume_memory_occupation"):
        assert requests.post(proc.url + path, timeout=30).status_code == 200, path
    assert client.reload_weights(model.a).success  # released weights come back zeroed: reload them
    assert_healthy_and_unchanged(proc.url, client, baseline)
