"""The gate and its reports, end to end: the reference passes, a planted mutant
(tests/framework/report_mutant.py) fails the gate, the Markdown table shows the failure, each repro command
reruns exactly the failing case, and failing tests' tensors are saved as safetensors.

Runs the real suite's dense module on a small subset (-k) through ci/run_conformance.py in a subprocess;
the artifact tests use a probe module written to a temporary directory.
Imports conformance._framework: it tests the framework itself."""
from __future__ import annotations

import json
import math
import os
import re
import shlex
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from conformance._framework.reporting import (NOT_SHOWN_HINT, NOT_SHOWN_KEY, area_of, known_failures_not_shown,
                                              merge_summaries, render_markdown, table_rows)

pytestmark = pytest.mark.integration  # starts servers or whole pytest runs (ci/time_tests.py times them apart)

REPO = Path(__file__).resolve().parents[2]
GATE = REPO / "ci" / "run_conformance.py"
MUTANT = "tests.framework.report_mutant:NoDecodeScaleMutant"
# A small, fast slice of the dense module: the bound check on three small n=160 shapes.
SUBSET = ["--tests", "conformance/dense/test_dense.py", "--", "-k",
          "matches_reference and (m1-n160 or m2-n160 or m3-n160)", "-q"]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env.pop("NVFP4_CONFORMANCE_BACKEND", None)
    return env


def run_gate(out: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(GATE), "--tier", "cpu", "--out", str(out), "--expectations", "none", *args]
    return subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=1200)


def table(markdown: str) -> list[dict[str, str]]:
    """The conformance table's rows as dicts keyed by header."""
    lines = markdown.split("## Conformance table", 1)[1].splitlines()
    rows = [line for line in lines if line.startswith("|")]
    header = [c.strip() for c in rows[0].strip("|").split("|")]
    return [dict(zip(header, (c.strip() for c in re.split(r"(?<!\\)\|", r.strip()[1:-1])))) for r in rows[2:]]


@pytest.fixture(scope="module")
def mutant_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gate-mutant")
    proc = run_gate(out, "--backend", MUTANT, "--workers", "0", *SUBSET)  # xdist: see test_expectations.py
    return proc, out


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gate-reference")
    return run_gate(out, "--backend", "reference", "--workers", "0", *SUBSET), out


def test_reference_passes_the_gate_with_all_three_reports(reference_run):
    proc, out = reference_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["verdict"] == "pass"
    assert summary["suite_version"] and summary["hardware"]
    assert summary["backends"][0]["name"] == "reference" and summary["backends"][0]["version"]
    assert summary["tiers"]["run"] == ["cpu"]
    passed = [t for t in summary["tests"] if t["outcome"] == "passed"]
    assert passed and all(t["area"] == "dense" and t["backend"] == "reference" for t in passed)
    suites = ET.parse(out / "junit.xml").getroot().findall("testsuite")
    assert sum(int(s.get("tests")) for s in suites) == len(summary["tests"])
    row = {r["Backend"]: r for r in table((out / "report.md").read_text())}["reference"]
    assert int(row["Pass"]) == len(passed) and row["Fail"] == "0"
    assert 0 <= float(row["Worst bound ratio"]) <= 1  # the dense check records bound_ratio on success


def test_mutant_fails_the_gate(mutant_run):
    proc, out = mutant_run
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "[gate] FAIL" in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["verdict"] == "fail"
    failed = [t for t in summary["tests"] if t["outcome"] == "failed"]
    assert failed and all("NoDecodeScaleMutant" in t["nodeid"] for t in failed)
    junit_failures = sum(int(s.get("failures")) for s in ET.parse(out / "junit.xml").getroot().iter("testsuite"))
    assert junit_failures == len(failed)
    from safetensors import safe_open

    for t in failed:  # the failing inputs and outputs, captured from the backend's calls
        path = next(Path(p) for p in t["artifacts"] if p.endswith("backend_calls.safetensors"))
        with safe_open(str(REPO / path), "pt") as f:
            assert {"run_dense.0.x", "run_dense.0.out", "prepare_dense.0.layer.weight"} <= set(f.keys())


def test_table_shows_the_mutants_failures(mutant_run):
    _, out = mutant_run
    summary = json.loads((out / "summary.json").read_text())
    failed = [t["nodeid"] for t in summary["tests"] if t["outcome"] == "failed"]
    markdown = (out / "report.md").read_text()
    assert "**Verdict: FAIL**" in markdown
    row = {(r["Area"], r["Backend"]): r for r in table(markdown)}[("dense", "NoDecodeScaleMutant")]
    assert int(row["Fail"]) == len(failed) and row["Pass"] == "0"
    assert failed[0].split("::", 1)[1] in row["Failing cases"]
    for nodeid in failed:  # each failure has its own section with the repro command
        assert f"### `{nodeid}`" in markdown


def test_repro_command_reruns_exactly_the_failing_case(mutant_run):
    _, out = mutant_run
    summary = json.loads((out / "summary.json").read_text())
    failure = next(t for t in summary["tests"] if t["outcome"] == "failed")
    cmd = shlex.split(failure["repro"])
    assert cmd[:3] == ["python", "-m", "pytest"] and "--backend" in cmd and MUTANT in cmd
    rerun = subprocess.run([sys.executable, *cmd[1:]], cwd=summary["repro_cwd"], env=_env(),
                           capture_output=True, text=True, timeout=1200)
    assert rerun.returncode != 0
    assert re.search(r"\b1 failed\b", rerun.stdout) and " passed" not in rerun.stdout.splitlines()[-1], rerun.stdout[-2000:]
    # the same command with the reference backend passes: the failure is the backend's, not the case's
    fixed = [("reference" if c == MUTANT else c.replace("NoDecodeScaleMutant", "reference")) for c in cmd]
    ok = subprocess.run([sys.executable, *fixed[1:]], cwd=summary["repro_cwd"], env=_env(),
                        capture_output=True, text=True, timeout=1200)
    assert ok.returncode == 0, ok.stdout[-2000:]


def test_misconfigured_gate_exits_2(tmp_path):
    proc = subprocess.run([sys.executable, str(GATE), "--tier", "h100", "--out", str(tmp_path)],
                          cwd=REPO, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2 and "unknown tier 'h100'" in proc.stderr


# ------------------------------------------------------------------------------ artifacts
PROBE = '''
import torch
from conformance.interfaces.kernel import DenseLayer
from conformance._framework.reporting import record_tensors
from reference_impl.format.nvfp4 import quantize_modelopt

def test_fails(backend, artifacts):
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3).bfloat16()
    artifacts.save("io", x=x, y=x.t())            # a view of x: must be written on its own
    record_tensors("scales", s=torch.tensor([1.5, 2.0]).to(torch.float8_e4m3fn))
    q = quantize_modelopt(torch.randn(32, 64))
    layer = DenseLayer(q.packed, q.block_scale, q.weight_scale_2.reshape(1), (32,))
    prepared = backend.prepare_dense(layer, torch.device("cpu"))
    for _ in range(6):                              # captured: the first 4 calls
        backend.run_dense(prepared, torch.ones(5, 64, dtype=torch.bfloat16))
    assert False, "planted failure"

def test_passes(artifacts):
    artifacts.save("io", x=torch.zeros(3))
'''


def test_failing_tests_tensors_are_saved_and_passing_ones_are_not(tmp_path):
    from safetensors import safe_open

    (tmp_path / "conftest.py").write_text('pytest_plugins = ["conformance.plugin"]\n')
    (tmp_path / "test_dense.py").write_text(textwrap.dedent(PROBE))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--report-dir", "out", "-q"],
                          cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 1, proc.stdout[-2000:]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    tests = {t["nodeid"]: t for t in summary["tests"]}
    failed = tests["test_dense.py::test_fails[reference]"]
    files = {Path(p).name: tmp_path / p for p in failed["artifacts"]}
    assert sorted(files) == ["backend_calls.safetensors", "io.safetensors", "scales.safetensors"]
    with safe_open(str(files["io.safetensors"]), "pt") as f:
        assert f.metadata()["nodeid"] == "test_dense.py::test_fails[reference]"
        assert f.get_tensor("y").shape == (3, 2) and f.get_tensor("x").dtype.is_floating_point
    with safe_open(str(files["backend_calls.safetensors"]), "pt") as f:  # captured without the test's help
        keys = set(f.keys())
        assert {"prepare_dense.0.layer.weight", "prepare_dense.0.layer.weight_scale", "run_dense.0.x",
                "run_dense.0.out", "run_dense.3.out"} <= keys and "run_dense.4.x" not in keys
        assert f.get_tensor("run_dense.0.out").shape == (5, 32)
    assert tests["test_dense.py::test_passes"]["artifacts"] == []
    assert sorted(p.name for p in (tmp_path / "out" / "artifacts").iterdir()) == ["test_dense.py_test_fails_reference"]
    assert "artifact: `out/artifacts/test_dense.py_test_fails_reference/io.safetensors`" in (
        tmp_path / "out" / "report.md").read_text()


def test_backend_capture_is_undone_after_each_test():
    from conformance._framework.report_files import _capture_backend_calls
    from conformance.adapters.reference.kernel import ReferenceBackend
    from conformance._framework.reporting import Artifacts

    backend = ReferenceBackend()
    sentinel = object()
    backend.prepare_moe = sentinel  # an instance attribute of the backend's own must survive
    restore = _capture_backend_calls(backend, Artifacts())
    assert vars(backend)["run_dense"].__name__ == "capture" and vars(backend)["prepare_moe"] is not sentinel
    restore()
    assert "run_dense" not in vars(backend) and vars(backend)["prepare_moe"] is sentinel


# ------------------------------------------------------------------------- pure functions
@pytest.mark.parametrize("nodeid,area", [
    ("conformance/format/test_format.py::test_x", "format"),
    ("conformance/dense/test_dense.py::test_x[a-b]", "dense"),
    ("conformance/moe/test_moe.py::test_x", "MoE"),
    ("conformance/rules/test_config_rules.py::test_x", "config rules"),
    ("conformance/rules/test_lm_head_guard.py::test_x", "LM head"),
    ("conformance/rules/test_reload_binding.py::test_x", "reload"),
    ("conformance/server/test_server_scenarios.py::test_x", "server"),
    ("conformance/engine_harness/test_engine_integration.py::test_x", "engine integration"),
    ("conformance/test_something_new.py::test_x", "other"),
    # the area comes from the package folder: a new module lands in its folder's area, whatever its name
    ("conformance/moe/test_routing.py::test_x", "MoE"),
    ("conformance/rules/test_vllm_rules.py::test_x", "config rules"),
    ("conformance/dense/test_dense_golden.py::test_x", "dense"),
    ("conformance/test_dense.py::test_x", "dense"),  # 0.1's flat layout: by file name
])
def test_area_of(nodeid, area):
    assert area_of(nodeid) == area


def _t(nodeid, outcome, backend="b", ratio=None, message=""):
    return {"nodeid": nodeid, "area": area_of(nodeid), "backend": backend, "tier": "cpu", "outcome": outcome,
            "message": message, "duration": 0.0, "properties": {} if ratio is None else {"bound_ratio": ratio},
            "repro": f"python -m pytest {nodeid}" if outcome in ("failed", "error", "xpass_strict") else None,
            "artifacts": []}


def _summary(tests, skipped=None):
    return {"suite_version": "0", "backend_spec": "b", "backends": [{"name": "b", "version": "1"}],
            "hardware": "hw", "tiers": {"run": ["cpu"], "skipped": skipped or {}}, "expectations": None,
            "run_errors": [], "tests": tests}


def test_table_counts_columns_and_worst_ratio_per_area_and_backend():
    tests = [
        _t("t/test_dense.py::a", "passed", ratio=0.5), _t("t/test_dense.py::b", "failed", ratio=3.0),
        _t("t/test_dense.py::c", "xfailed"), _t("t/test_dense.py::d", "skipped", message="why"),
        _t("t/test_dense.py::e", "xpass_strict"), _t("t/test_dense.py::f", "error"),
        _t("t/test_dense.py::g", "passed", backend="other", ratio=float("nan")),
        _t("t/test_format.py::h", "passed", backend="-"),
    ]
    rows = {(r["area"], r["backend"]): r for r in table_rows(tests)}
    dense = rows[("dense", "b")]
    assert (dense["pass"], dense["fail"], dense["xfail"], dense["skip"]) == (1, 3, 1, 1)
    assert dense["worst_bound_ratio"] == 3.0
    assert dense["failing"] == ["t/test_dense.py::b", "t/test_dense.py::e", "t/test_dense.py::f"]
    assert math.isnan(rows[("dense", "other")]["worst_bound_ratio"])  # a NaN error is the worst there is
    assert rows[("format", "-")]["worst_bound_ratio"] is None
    assert [r["area"] for r in table_rows(tests)][0] == "format"  # areas in the documented order
    md = render_markdown(_summary(tests, {"b200": "needs SM100/SM103"}))
    assert "**Verdict: FAIL** (3 gate failures)" in md
    assert "| dense | b | 1 | 3 | 1 | 1 | 3 | `b`, `e`, `f` |" in md
    assert "b200 (needs SM100/SM103)" in md and "| why | 1 |" in md


def test_merge_keeps_every_tier_runs_tests_and_skipped_tiers():
    cpu = _summary([_t("t/test_dense.py::a", "passed")])
    gpu = _summary([_t("t/test_dense.py::b", "passed")])
    gpu["tiers"]["run"] = ["cuda"]
    merged = merge_summaries([cpu, gpu], {"b200": "needs SM100/SM103"})
    assert [t["nodeid"] for t in merged["tests"]] == ["t/test_dense.py::a", "t/test_dense.py::b"]
    assert merged["tiers"] == {"run": ["cpu", "cuda"], "skipped": {"b200": "needs SM100/SM103"}}
    assert merged["verdict"] == "pass"
    assert render_markdown(merged).startswith("# NVFP4 W4A16 conformance report\n\n**Verdict: PASS**")


def _covered(t, entry, reason, why=None):
    """A test an [[xfail]] entry covers, with the properties the expectations plugin records."""
    t["properties"] = {"known_failure_entry": entry, "known_failure_reason": reason,
                       **({"known_failure_why_not_strict": why} if why else {})}
    return t


def test_non_strict_xpass_gets_its_own_section_and_list_but_no_failure():
    """A known failure that did not show (XPASS of a non-strict entry) is listed with the entry's reason and
    why_not_strict, under the hint; a strict xfail and a non-strict one that failed are not; the verdict is PASS."""
    xpassed = _covered(_t("t/test_server.py::test_batch[vllm]", "xpassed", message="known failure (non-strict: w)"),
                       "t/test_server.py::test_batch", "not batch invariant (https://x/1)", "only when | co-batched")
    strict = _covered(_t("t/test_server.py::test_reload", "xfailed", message="known failure: r"),
                      "t/test_server.py::test_reload", "reload reports success")
    failed_as_recorded = _covered(_t("t/test_server.py::test_batch[sglang]", "xfailed"),
                                  "t/test_server.py::test_batch", "not batch invariant (https://x/1)", "w")
    passed = _t("t/test_server.py::test_ok", "passed")
    tests = [xpassed, strict, failed_as_recorded, passed]
    listed = {"nodeid": "t/test_server.py::test_batch[vllm]", "backend": "b", "tier": "cpu",
              "entry": "t/test_server.py::test_batch", "reason": "not batch invariant (https://x/1)",
              "why_not_strict": "only when | co-batched"}
    assert known_failures_not_shown(tests) == [listed]
    md = render_markdown(_summary(tests))
    assert "**Verdict: PASS**" in md and "- Known failures that did not show: 1 (non-strict XPASS" in md
    section = md.split("\n## Known failures that did not show (non-strict XPASS)\n", 1)[1].split("\n## ", 1)[0]
    assert NOT_SHOWN_HINT in section
    assert [line for line in section.splitlines() if line.startswith("| `")] == [
        "| `t/test_server.py::test_batch[vllm]` | `t/test_server.py::test_batch` | not batch invariant "
        "(https://x/1) | only when \\| co-batched |"]
    assert "test_reload" not in section and "[sglang]" not in section
    # the expected failures keep their own table; nothing else is said about them
    assert "did not show" not in render_markdown(_summary([strict, failed_as_recorded, passed]))
    # an XPASS outside an expectations file (an xfail marker in the test) is listed with its marker's reason
    marker = _t("t/test_dense.py::m", "xpassed", message="flaky on purpose")
    assert known_failures_not_shown([marker]) == [{"nodeid": "t/test_dense.py::m", "backend": "b", "tier": "cpu",
                                                   "entry": None, "reason": "flaky on purpose", "why_not_strict": None}]
    merged = merge_summaries([_summary([strict, passed]), _summary([xpassed])], {})
    assert merged[NOT_SHOWN_KEY] == [listed] and merged["verdict"] == "pass"
    assert merge_summaries([_summary([strict, passed])], {})[NOT_SHOWN_KEY] == []


# ------------------------------------------------------------------------------ tier plan
def _gate_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("run_conformance", GATE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tier_plan_on_an_h200(monkeypatch):
    from conformance._framework.tiers import Gpu, Hardware

    gate = _gate_module()
    monkeypatch.setattr(gate, "detect_hardware", lambda: Hardware((Gpu("NVIDIA H200", (9, 0)),)))
    runs, absent = gate.plan_runs("all")
    # xdist for everything but the present GPU tiers; those run serially, one run each
    assert runs == [("cpu", "not (cuda or sm90)", True), ("cuda", "cuda", False), ("sm90", "sm90", False)]
    assert set(absent) == {"b200", "multi_gpu", "b200_4gpu"}
    assert gate.plan_runs("cuda") == ([("cuda", "cuda", False)], {})
    with pytest.raises(gate.GateConfigError, match="tier 'b200' is not present on this machine: needs SM100/SM103"):
        gate.plan_runs("b200")


def test_tier_plan_on_a_cpu_machine_counts_every_gpu_test_as_skipped(monkeypatch):
    from conformance._framework.tiers import Hardware

    gate = _gate_module()
    monkeypatch.setattr(gate, "detect_hardware", lambda: Hardware())
    runs, absent = gate.plan_runs("cpu")
    assert runs == [("cpu", None, True)] and set(absent) == {"cuda", "sm90", "b200", "multi_gpu", "b200_4gpu"}
    assert gate.plan_runs("all") == (runs, absent)


def test_emulated_b200_runs_are_marked_and_never_counted_as_b200():
    """--flashinfer-emulated: the verdict line says EMULATED, the tier is listed as emulated (not run, not
    skipped), the rows carry "(emulated)", and a merge keeps all of it."""
    from conformance._framework.reporting import EMULATED_B200_TIER, EMULATED_VERDICT_NOTE

    emulated = _t("t/test_dense.py::a[flashinfer-cudnn-x]", "passed", backend="flashinfer-cudnn", ratio=0.2)
    emulated["tier"] = EMULATED_B200_TIER
    run = _summary([emulated])
    run["tiers"] = {"run": ["cpu"], "skipped": {}, "emulated": ["b200"]}
    run["flashinfer_emulated"] = True
    md = render_markdown(run)
    assert f"**Verdict: PASS**; {EMULATED_VERDICT_NOTE}" in md
    assert "- Tiers run: cpu, b200 (EMULATED, not a b200 result)" in md
    assert "| dense | flashinfer-cudnn (emulated) | 1 | 0 | 0 | 0 | 0.2 |  |" in md
    gpu = _summary([_t("t/test_dense.py::b", "passed")])
    gpu["tiers"] = {"run": ["cuda"], "skipped": {"b200": "needs SM100/SM103"}}
    merged = merge_summaries([run, gpu], {"b200": "needs SM100/SM103, found SM90 (NVIDIA H200)"})
    assert merged["flashinfer_emulated"] is True and merged["tiers"]["emulated"] == ["b200"]
    assert "b200" not in merged["tiers"]["skipped"] and "b200" not in merged["tiers"]["run"]
    assert EMULATED_VERDICT_NOTE in render_markdown(merged)


def test_tier_plan_with_the_b200_tier_emulated(monkeypatch):
    """With a GPU the emulated b200 tier gets its own serial run on it; without one it stays in the parallel
    CPU run (and --tier b200 runs it in parallel there); it is never reported as absent."""
    from conformance._framework.tiers import Gpu, Hardware

    gate = _gate_module()
    monkeypatch.setattr(gate, "detect_hardware", lambda: Hardware((Gpu("NVIDIA H200", (9, 0)),)))
    runs, absent = gate.plan_runs("all", emulated=True)
    assert runs == [("cpu", "not (cuda or sm90 or b200)", True), ("cuda", "cuda", False), ("sm90", "sm90", False),
                    ("b200", "b200", False)]
    assert "b200" not in absent and gate.plan_runs("b200", emulated=True) == ([("b200", "b200", False)], {})
    monkeypatch.setattr(gate, "detect_hardware", lambda: Hardware())
    runs, absent = gate.plan_runs("all", emulated=True)
    assert runs == [("cpu", None, True)] and "b200" not in absent
    assert gate.plan_runs("b200", emulated=True) == ([("b200", "b200", True)], {})
