"""Self-tests of the perf tier (:mod:`conformance.perf.measure`, :mod:`conformance.perf.plugin`), the comma list
of backends, and the example third-party backend (``examples/torchao_nvfp4_backend.py``)."""
from __future__ import annotations

import types

import pytest
import torch

from conformance.perf import measure as perf
from conformance.perf.plugin import PerfGate, load_perf_gates, perf_selected
from conformance.backends import BackendLoadError, load_backends
from conformance.adapters.reference.kernel import ReferenceBackend
from conformance._framework.reporting import render_markdown  # private: the perf rows' rendering in report.md is under test


def _row(**overrides) -> perf.PerfRow:
    values = dict(kind="dense", backend="b", shape="4096x4096", tokens=1, time_s=2e-5, baseline_s=1e-5, floor_s=5e-6,
                  nbytes=1e7, flops=3.3e7, baseline="torch.matmul bf16")
    values.update(overrides)
    return perf.PerfRow(**values)


def test_row_figures_and_flags() -> None:
    row = _row()
    assert row.vs_bf16 == pytest.approx(2.0) and row.vs_floor == pytest.approx(4.0)
    assert row.gbps == pytest.approx(500.0) and row.tflops == pytest.approx(1.65)
    assert row.flags() and "slower than BF16 at 1 token" in row.flags()[0]
    assert _row(tokens=256).flags() == [] and _row(time_s=0.5e-5).flags() == []


def test_floor_is_the_larger_of_memory_and_compute_time() -> None:
    rates = perf.DeviceRates("x", copy_bytes_per_s=1e12, bf16_flops_per_s=1e15)
    assert rates.floor_time(1e9, 1e9) == pytest.approx(1e-3)  # memory bound
    assert rates.floor_time(1e6, 1e13) == pytest.approx(1e-2)  # compute bound
    nbytes, flops = perf.dense_bytes_and_flops(1, 4096, 4096)
    assert nbytes == pytest.approx(4096 * 4096 * (0.5 + 1 / 16) + 4 + 2 * 4096 * 2) and flops == 2 * 4096 * 4096


def test_gates_fail_only_beyond_their_limits(tmp_path) -> None:
    gate = PerfGate("x", "why", max_vs_bf16=1.0)
    assert gate.violations(_row(time_s=0.9e-5).as_dict()) == []
    assert "vs_bf16 = 2.000 > 1.0 (why)" in gate.violations(_row().as_dict())[0]
    path = tmp_path / "perf.toml"
    path.write_text('[[perf]]\nid = "conformance/perf/test_perf.py::"\nmax_vs_floor = 3\nreason = "floor"\n')
    assert load_perf_gates(path) == [PerfGate("conformance/perf/test_perf.py::", "floor", max_vs_floor=3.0)]
    for bad, message in [('[[perf]]\nid = "a"\nreason = "r"\n', "at least one positive limit"),
                         ('[[perf]]\nid = "a"\nreason = "r"\nmax_vs_bf16 = 1\nspeed = 2\n', "unknown key"),
                         ('[[xfail]]\nid = "a"\n', "unknown section"), ('[[perf]]\nmax_vs_bf16 = 1\n', "'id'")]:
        path.write_text(bad)
        with pytest.raises(pytest.UsageError, match=message):
            load_perf_gates(path)


def test_perf_tests_run_only_when_selected() -> None:
    def config(markexpr):
        return types.SimpleNamespace(getoption=lambda name, default=None: markexpr)

    assert perf_selected(config("perf")) and perf_selected(config("perf and cuda"))
    assert not perf_selected(config("cuda")) and not perf_selected(config(""))


def test_measurements_and_report_section_on_cpu() -> None:
    timer = perf.Timer(torch.device("cpu"), warmup=1, repeats=2)
    rates = perf.DeviceRates("CPU", 1e10, 1e11)
    dense_row = perf.measure_dense(ReferenceBackend(), 64, 64, 2, rates, timer)
    moe_row = perf.measure_moe(ReferenceBackend(), "t", 4, 64, 32, 2, 3, rates, timer)
    assert dense_row.time_s > 0 and dense_row.baseline == "torch.matmul bf16" and moe_row.kind == "moe"
    tests = [{"nodeid": f"conformance/perf/test_perf.py::t{i}", "area": "perf", "backend": "reference", "tier": "cpu",
              "outcome": "passed", "message": "", "duration": 0.0, "repro": None, "artifacts": [],
              "properties": {"perf": {**r.as_dict(), "yardsticks": perf.format_rate(rates)}}}
             for i, r in enumerate((dense_row, moe_row))]
    summary = {"tests": tests, "backends": [], "tiers": {"run": ["cpu"], "skipped": {}}, "suite_version": "0",
               "backend_spec": "reference", "hardware": "cpu"}
    text = render_markdown(summary)
    assert "## Performance" in text and "| dense | reference | 64x64 | 2 |" in text and "tokens" in text
    assert "yardsticks: CPU: copy 10 GB/s" in text and "| perf | reference | 2 |" in text


def test_comma_separated_backends() -> None:
    names = [b.name for b in load_backends("reference,tests.framework.report_mutant:NoDecodeScaleMutant")]
    assert names == ["reference", "NoDecodeScaleMutant"]
    with pytest.raises(BackendLoadError, match="more than once"):
        load_backends("reference,reference")


def test_example_torchao_backend_passes_the_cpu_dense_checks() -> None:
    """The example adapter (examples/torchao_nvfp4_backend.py) passes every dense check on the cpu cases and
    declares MoE unsupported. Skipped without the optional extra."""
    pytest.importorskip("torchao", reason="needs the optional extra 'torchao' "
                                          "(pip install 'nvfp4-w4a16-conformance[torchao]')")
    from conformance.dense.checks import failing_checks
    from conformance.dense.cases import CPU_CASES
    from examples.torchao_nvfp4_backend import TorchaoNVFP4Backend

    backend = TorchaoNVFP4Backend()
    rejected = {case.id: f for case in CPU_CASES if (f := failing_checks(backend, case))}
    assert not rejected, rejected
    assert "torchao" in backend.version()
    with pytest.raises(NotImplementedError, match="no W4A16 fused MoE"):
        backend.prepare_moe(None, torch.device("cpu"))
