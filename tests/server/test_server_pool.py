"""The server pool of the scenario suite (conformance/server/plugin.py): a server that dies in one scenario
is replaced for the next, so only the scenario that killed it fails (vLLM 0.32's engine dies after a failed
reload); servers are stopped after their last test."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration  # starts servers or whole pytest runs (ci/time_tests.py times them apart)

REPO = Path(__file__).resolve().parents[2]
MUTANT = ("{python} tests/server/mutants.py --mutant dies_after_failed_reload --model-path {model_path} "
          "--tokenizer-path {tokenizer_path} --port {port} --tp {tp} --device {device}")


def test_a_server_that_dies_is_replaced(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_XDIST", "NVFP4_CONFORMANCE_SERVER_API"))}
    env["TMPDIR"] = str(tmp_path)  # the launcher's log files, one per server started, all kept
    env["NVFP4_SERVER_KEEP_LOGS"] = "1"
    r = subprocess.run([sys.executable, "-m", "pytest", "conformance/server/test_server_scenarios.py", "-p",
                        "no:cacheprovider", "-q", "-rA", "--server-cmd", MUTANT, "--server-configs", "cpu-tp1",
                        "--server-models", "dense-nvfp4_awq", "-k",
                        "failed_reload_missing_path or repeated_requests_deterministic", "-o", "tmp_path_retention_policy=all"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    out = r.stdout
    assert "1 failed, 1 passed" in out, out[-3000:] + r.stderr[-2000:]
    assert "FAILED conformance/server/test_server_scenarios.py::test_server_scenario[sglang-cpu-tp1-dense-nvfp4_awq-" \
           "failed_reload_missing_path]" in out
    assert "is gone or unhealthy after an earlier scenario: starting a new one" in out
    assert len(list(tmp_path.rglob("nvfp4-server-*.log"))) == 2
