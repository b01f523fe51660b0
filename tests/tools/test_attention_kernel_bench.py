"""benchmarks/bench_attention_kernel.py runs end to end (the kernels by Triton's CPU interpreter): a row for the
eager path and one per configuration, the first configuration the default and each compared with it; a
malformed configuration is refused with the expected format."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(os.environ.get("NVFP4_SKIP_TRITON_INTERPRETER") == "1", reason="disabled by environment")
def test_the_bench_times_eager_and_each_configuration() -> None:
    pytest.importorskip("triton", reason="Triton not installed (it ships with CUDA torch builds)")
    cmd = [sys.executable, "benchmarks/bench_attention_kernel.py", "--device", "cpu", "--lengths", "40", "--heads",
           "2", "--dim", "16", "--replicas", "2", "--configs", "16,16,4,1,tf32x3"]
    env = {k: v for k, v in os.environ.items() if k != "TRUTH_ATTENTION_CONFIG"}
    done = subprocess.run(cmd, cwd=REPO, env={**env, "TRITON_INTERPRET": "1"}, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line.split("|") for line in done.stdout.splitlines() if line.startswith("| 40 |")]
    assert [(r[2].strip(), r[3].strip()) for r in rows] == [("eager", ""), ("kernel", "64,32,8,1,ieee"),
                                                            ("kernel", "16,16,4,1,tf32x3")], done.stdout
    assert float(rows[1][8]) == 0.0  # the first configuration against itself
    assert float(rows[2][8]) < 1e-5  # another blocking of the same fp32 arithmetic (no draws)

    bad = subprocess.run(cmd[:-1] + ["16,16,4"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "BLOCK_M,BLOCK_N,WARPS,STAGES,PRECISION" in bad.stderr, bad.stderr[-1000:]
