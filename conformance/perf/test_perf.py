"""The perf tier (``pytest -m perf conformance/ --backend NAME``): per LLM shape and token count, the
backend's time, achieved GB/s and TFLOP/s, and its ratio to a BF16 baseline and to the W4A16 floor, all
measured in this run (:mod:`conformance.perf.measure`). On a CUDA machine the LLM shapes at M in {1, 16, 256, 4096};
on a CPU-only machine small shapes (a check of the machinery). Findings are flags recorded in the report;
``--perf-expectations`` turns chosen ones into failures."""
from __future__ import annotations

import pytest
import torch

from conformance.perf import measure as perf
from conformance.interfaces.kernel import Backend

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TIER = pytest.mark.cuda if DEVICE.type == "cuda" else pytest.mark.cpu
_MOE_CACHE: dict = {}  # one MoE shape's prepared layer, reused across its token counts


@pytest.fixture(scope="session")
def perf_timer() -> perf.Timer:
    return perf.Timer(DEVICE)


@pytest.fixture(scope="session")
def device_rates() -> perf.DeviceRates:
    return perf.measure_device_rates(DEVICE)


def _record(record_property, row: perf.PerfRow, rates: perf.DeviceRates) -> dict:
    data = row.as_dict()
    data["yardsticks"] = perf.format_rate(rates)
    record_property("perf", data)
    assert perf.is_finite_row(data), f"non-finite timing: {data}"
    return data


@pytest.mark.perf
@TIER
@pytest.mark.parametrize("n,k,m", perf.dense_shapes(DEVICE.type),
                         ids=[f"n{n}-k{k}-m{m}" for n, k, m in perf.dense_shapes(DEVICE.type)])
def test_dense_perf(backend: Backend, n, k, m, perf_timer, device_rates, record_property, perf_gate) -> None:
    reason = backend.skip_reason(perf.dense_case_info(n, k, m, DEVICE))
    if reason:
        pytest.skip(reason)
    perf_gate(_record(record_property, perf.measure_dense(backend, n, k, m, device_rates, perf_timer), device_rates))


@pytest.mark.perf
@TIER
@pytest.mark.parametrize("name,experts,hidden,inter,top_k,tokens", perf.moe_shapes(DEVICE.type),
                         ids=[f"{s[0]}-t{s[-1]}" for s in perf.moe_shapes(DEVICE.type)])
def test_moe_perf(backend: Backend, name, experts, hidden, inter, top_k, tokens, perf_timer, device_rates,
                  record_property, perf_gate) -> None:
    reason = backend.skip_reason(perf.moe_case_info(experts, hidden, inter, top_k, tokens, DEVICE))
    if reason:
        pytest.skip(reason)
    try:
        row = perf.measure_moe(backend, name, experts, hidden, inter, top_k, tokens, device_rates, perf_timer, _MOE_CACHE)
    except NotImplementedError as exc:  # the adapter's documented way to declare "no fused MoE"
        pytest.skip(f"{backend.name}: {exc}")
    perf_gate(_record(record_property, row, device_rates))
