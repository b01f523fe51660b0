"""Runs a Triton kernel's self-test script under Triton's CPU interpreter, in a subprocess (``TRITON_INTERPRET``
must be set before Triton is imported; the test process may already have imported it)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def run_script(script: str, out: Path, *args, timeout: int = 600) -> Path:
    """``script`` run with ``sys.argv[1:] = [out, *args]`` (it saves its results under ``out``); skipped where
    Triton is not installed or ``NVFP4_SKIP_TRITON_INTERPRETER=1``."""
    pytest.importorskip("triton")
    if os.environ.get("NVFP4_SKIP_TRITON_INTERPRETER") == "1":
        pytest.skip("disabled by environment")
    subprocess.run([sys.executable, "-c", script, str(out), *map(str, args)], check=True,
                   env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO, timeout=timeout)
    return out
