"""``--server-api`` / ``$NVFP4_CONFORMANCE_SERVER_API`` end to end: the scenario suite speaks the chosen
dialect to a launched and to an attached reference server, runs the generation scenarios through it, skips
the ones needing endpoints the API lacks with the API's reason (never a pass), and refuses an unknown API
at start. (Every scenario through every dialect, and the mutants caught through each, are in
tests/server/test_server_mutants.py; this module checks the wiring of the option.)"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conformance.server.plugin import SERVER_API_ENV
from conformance.server.dialects import DIALECTS
from fixtures.make_checkpoints import ensure_checkpoints
from tests.server.live_reference_server import live_reference_server

pytestmark = pytest.mark.integration  # starts servers or whole pytest runs (ci/time_tests.py times them apart)

REPO = Path(__file__).resolve().parents[2]
TWO_SCENARIOS = "repeated_requests_deterministic or reload_different_weights"


def _suite(*args: str, api_env: str | None = None, timeout: float = 300, tmpdir: Path | None = None
           ) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_XDIST", SERVER_API_ENV))}
    if tmpdir is not None:  # where the launcher writes one log file per server it starts, all kept
        env["TMPDIR"] = str(tmpdir)
        env["NVFP4_SERVER_KEEP_LOGS"] = "1"
        args = (*args, "-o", "tmp_path_retention_policy=all")
    if api_env is not None:
        env[SERVER_API_ENV] = api_env
    cmd = [sys.executable, "-m", "pytest", "conformance/server/test_server_scenarios.py", "-p", "no:cacheprovider", "-q",
           "-rs", *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("how", ["option", "environment"])
def test_unknown_api_is_a_usage_error(how):
    r = _suite("--collect-only", *(["--server-api", "tgi"] if how == "option" else []),
               api_env="tgi" if how == "environment" else None, timeout=120)
    assert r.returncode == 4, r.stdout[-2000:] + r.stderr[-2000:]
    assert f"--server-api 'tgi' (or ${SERVER_API_ENV}): known APIs: {', '.join(DIALECTS)}" in r.stderr


def test_openai_from_the_environment_runs_generation_and_skips_reload():
    """The launched reference server through the openai dialect: determinism runs (checking the start-up
    weights instead of reloading a), the reload scenario skips naming the missing endpoint."""
    r = _suite("--server-configs", "cpu-tp1", "--server-models", "dense-nvfp4_awq", "-k", TWO_SCENARIOS,
               api_env="openai")
    out = r.stdout
    assert r.returncode == 0 and "1 passed, 1 skipped" in out, out[-3000:] + r.stderr[-2000:]
    assert ("reload_different_weights: skipped: the openai API cannot reload_weights (the OpenAI API has no "
            "weight or memory endpoints)") in out


def test_option_overrides_the_environment_and_attaches(tmp_path):
    """``--server-api vllm`` wins over the environment's openai; against an attached server (its checkpoint
    read from /v1/models) both scenarios run through vLLM's endpoints."""
    model = ensure_checkpoints() / "dense-nvfp4_awq-a"
    with live_reference_server(model) as (url, engine):
        r = _suite("--server-url", url, "--server-api", "vllm", "-k", TWO_SCENARIOS, api_env="openai")
        assert engine.weight_version > 0, "the vllm dialect never reloaded: the scenarios did not reach the server"
    assert r.returncode == 0 and "2 passed" in r.stdout, r.stdout[-3000:] + r.stderr[-2000:]


def test_several_apis_share_one_server_each(tmp_path):
    """``--server-api openai,vllm``: every scenario through each API (ids start with it), API by API in the
    order given, on one server per config and model: the openai reload scenario skips, the vllm one runs."""
    r = _suite("--server-configs", "cpu-tp1", "--server-models", "dense-nvfp4_awq", "-k", TWO_SCENARIOS,
               "--server-api", "openai,vllm", "-rA", tmpdir=tmp_path)
    out = r.stdout
    assert r.returncode == 0 and "3 passed, 1 skipped" in out, out[-3000:] + r.stderr[-2000:]
    passed = sorted(line.split("[", 1)[1].split("]", 1)[0] for line in out.splitlines()
                    if line.startswith("PASSED") and "test_server_scenario[" in line)
    assert passed == ["openai-cpu-tp1-dense-nvfp4_awq-repeated_requests_deterministic",
                      "vllm-cpu-tp1-dense-nvfp4_awq-reload_different_weights",
                      "vllm-cpu-tp1-dense-nvfp4_awq-repeated_requests_deterministic"]
    assert "reload_different_weights: skipped: the openai API cannot reload_weights" in out
    assert len(list(tmp_path.rglob("nvfp4-server-*.log"))) == 1  # one server served both APIs


def test_repeated_api_is_a_usage_error():
    r = _suite("--collect-only", "--server-api", "vllm,vllm", timeout=120)
    assert r.returncode == 4 and "without repeats" in r.stderr, r.stderr[-2000:]
