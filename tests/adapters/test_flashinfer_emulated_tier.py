"""The b200 tier rehearsed on the CPU (``pytest -m b200 --flashinfer-emulated``): the exact b200 code path with
FlashInfer's entry points routed to the emulator passes, a layout bug planted in the FlashInfer adapter
(tests/adapters/flashinfer_mutants.py) makes it fail in the check that owns that layout, and the reports mark the
run EMULATED without counting a single test as a B200 result.

Runs the real suite in subprocesses on a small slice (-k) of the dense and MoE modules."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# private: the report's own tier name and verdict wording, which this test asserts the emulated run's report carries
from conformance._framework.reporting import EMULATED_B200_TIER, EMULATED_VERDICT_NOTE

pytestmark = pytest.mark.integration  # starts servers or whole pytest runs (ci/time_tests.py times them apart)

pytest_plugins = ["pytester"]

REPO = Path(__file__).resolve().parents[2]
MOE_IDS = ("t7_e8_k2_h192_i192", "t128_e8_k2_geglu", "t128_e8_k2_ep2")
DENSE_IDS = ("flashinfer-cute-dsl-cpu-square-n192-k192", "flashinfer-cudnn-cpu-square-n192-k192")
SLICE = " or ".join([f"flashinfer-cute-dsl-{i}" for i in MOE_IDS] + list(DENSE_IDS))
SELECT = f"({SLICE}) and (matches_reference or expert_parallel_sum)"
EXPECTED = {  # test id -> check whose failure message must appear (each check's own wording)
    **{f"conformance/moe/test_moe.py::test_moe_matches_reference[flashinfer-cute-dsl-{i}]": "[moe_within_bound]" for i in MOE_IDS},
    "conformance/moe/test_moe.py::test_moe_expert_parallel_sum[flashinfer-cute-dsl-t128_e8_k2_ep2]": "[moe_",
    **{f"conformance/dense/test_dense.py::test_dense_matches_reference[{i}]": "outside the derived error bound" for i in DENSE_IDS},
}


def _emulated_run(tmp_path: Path, mutants: str) -> tuple[subprocess.CompletedProcess, dict]:
    env = dict(os.environ, NVFP4_FLASHINFER_ADAPTER_MUTANTS=mutants)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    for var in ("NVFP4_CONFORMANCE_BACKEND", "NVFP4_FLASHINFER_EMULATED", "PYTEST_XDIST_WORKER_COUNT"):
        env.pop(var, None)
    cmd = [sys.executable, "-m", "pytest", "-m", "b200", "conformance/moe/test_moe.py", "conformance/dense/test_dense.py",
           "--flashinfer-emulated", "-p", "tests.adapters.flashinfer_mutants", "-k", SELECT, "-q",
           "-p", "no:cacheprovider", "--report-dir", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    summary_path = tmp_path / "summary.json"
    assert summary_path.exists(), f"no report written:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc, json.loads(summary_path.read_text())


@pytest.fixture(scope="module")
def control(tmp_path_factory):
    return _emulated_run(tmp_path_factory.mktemp("emulated-control"), "")


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    return _emulated_run(tmp_path_factory.mktemp("emulated-mutant"), "w13-gate-up,dense-linear-scales")


def test_emulated_b200_slice_passes_and_is_marked_emulated(control):
    proc, summary = control
    outcomes = {t["nodeid"]: t["outcome"] for t in summary["tests"]}
    assert proc.returncode == 0 and set(outcomes) == set(EXPECTED), proc.stdout[-3000:]
    assert set(outcomes.values()) == {"passed"}, outcomes
    assert summary["flashinfer_emulated"] is True and summary["tiers"]["emulated"] == ["b200"]
    assert "b200" not in summary["tiers"]["run"] and "b200" not in summary["tiers"]["skipped"]
    assert {t["tier"] for t in summary["tests"]} == {EMULATED_B200_TIER}  # none counted as a b200 result
    report = (Path(summary["repro_cwd"]) / proc.args[proc.args.index("--report-dir") + 1] / "report.md").read_text()
    assert f"**Verdict: PASS**; {EMULATED_VERDICT_NOTE}" in report
    assert "| dense | flashinfer-cute-dsl (emulated) |" in report and "b200 (EMULATED, not a b200 result)" in report


def test_planted_adapter_layout_bugs_fail_the_emulated_b200_tier(planted):
    """``[gate; up]`` W13 handed to the kernel's ``[up; gate]`` interleave, and linear dense scales padded to
    the swizzled size: every selected test fails, in the check that owns the numbers."""
    proc, summary = planted
    tests = {t["nodeid"]: t for t in summary["tests"]}
    assert proc.returncode == 1 and set(tests) == set(EXPECTED), proc.stdout[-3000:]
    for nodeid, check in EXPECTED.items():
        assert tests[nodeid]["outcome"] == "failed", (nodeid, tests[nodeid]["outcome"])
        assert check in tests[nodeid]["message"], (nodeid, tests[nodeid]["message"])
        assert "--flashinfer-emulated" in tests[nodeid]["repro"]  # the repro reruns the emulated case
    assert summary["verdict"] == "fail" and summary["flashinfer_emulated"] is True


def _collect(pytester: pytest.Pytester, marker: str) -> list[str]:
    """Test ids ``pytest -m marker --collect-only`` selects from the suite's modules (in-process: no second
    torch import). Runs from the repository root, so the root conftest loads the suite's plugin."""
    paths = ["conformance/dense/test_dense.py", "conformance/moe/test_moe.py", "conformance/dense/test_dense_golden.py",
             "conformance/engine_harness/test_engine_integration.py"]
    result = pytester.runpytest_inprocess("-m", marker, "--collect-only", "-q", "-p", "no:cacheprovider",
                                          "--rootdir", str(REPO), *paths)
    assert result.ret == 0, "\n".join(result.outlines[-20:])
    return [line for line in result.outlines if "::" in line]


def test_b200_selects_exactly_the_flashinfer_tests(pytester, monkeypatch):
    """Without --backend the suite runs the reference and FlashInfer; every test against a FlashInfer backend
    (any case tier) and the harness's real-FlashInfer variant is b200, and only those are."""
    monkeypatch.delenv("NVFP4_CONFORMANCE_BACKEND", raising=False)
    monkeypatch.chdir(REPO)
    b200, rest = _collect(pytester, "b200"), _collect(pytester, "not b200")
    assert b200 and all("[flashinfer-" in i or "_integration_flashinfer[" in i for i in b200), b200[:5]
    assert rest and not any("[flashinfer-" in i or "_integration_flashinfer[" in i for i in rest)
    cases = {i.split("[", 1)[1] for i in b200 if "test_dense_matches_reference[" in i}
    assert {c.split("-cpu-")[0] for c in cases if "-cpu-" in c} == {
        f"flashinfer-{b}" for b in ("cudnn", "cute-dsl", "cute-dsl-native", "blackwell-native", "blackwell-tiled")
    }
