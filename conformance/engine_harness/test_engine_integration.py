"""An engine's real NVFP4 integration code (dense W4A16, dense W4A4, fused MoE W4A16) run against the
FlashInfer emulator and judged against the checkpoint reference (cpu tier), and the same cases with the engine's
layer code calling the real FlashInfer kernels on the GPU (``b200`` tier; under ``--flashinfer-emulated`` the
emulator again, on this host's device, through the b200 code path). Select the engine with ``--engine``
(default: sglang); the tests skip with the adapter's reason when the engine is not installed.

Each case runs the whole scenario (build, load through the engine's loaders, post-load, forward, reload,
forward) and applies the named checks of :mod:`conformance.engine_harness.checks`. An engine adapter can
declare known deviations (``known_deviations``: case id -> reason); such a case must still fail (strict),
so a fixed engine is noticed.
"""
from __future__ import annotations

import pytest

from conformance._framework.cases import as_params
from conformance.engine_harness.cases import DENSE_CASES, MOE_CASES
from conformance.engine_harness.checks import failing_checks


def _judge(engine_adapter, case, platform=None) -> None:
    reason = engine_adapter.case_skip_reason(case)
    if reason:
        pytest.skip(f"{engine_adapter.name}: {reason}")
    failures = failing_checks(engine_adapter, case, platform)
    known = getattr(engine_adapter, "known_deviations", {}).get(case.id)
    if known:
        assert failures, f"{case.id}: declared as a known deviation ({known}) but every check passes now"
        pytest.xfail(f"known {engine_adapter.name} deviation: {known} [failing: {', '.join(failures)}]")
    assert not failures, "\n".join(f"[{name}] {msg}" for name, msg in failures.items())


@pytest.mark.parametrize("case", as_params(DENSE_CASES))
def test_dense_integration(engine_adapter, case):
    _judge(engine_adapter, case)


@pytest.mark.parametrize("case", as_params(MOE_CASES))
def test_moe_integration(engine_adapter, case):
    _judge(engine_adapter, case)


@pytest.mark.b200
@pytest.mark.parametrize("case", as_params(DENSE_CASES))
def test_dense_integration_flashinfer(engine_adapter, case):
    _judge(engine_adapter, case, _flashinfer_platform("dense"))


@pytest.mark.b200
@pytest.mark.parametrize("case", as_params(MOE_CASES))
def test_moe_integration_flashinfer(engine_adapter, case):
    _judge(engine_adapter, case, _flashinfer_platform("moe"))


def _flashinfer_platform(kind: str):
    """The b200 tier's FlashInfer (installed, or the emulator under --flashinfer-emulated); skips, naming why,
    when it cannot run what the engine calls: SGLang's W4A16/W4A4 paths use the ``cute-dsl`` GEMM backend and
    the CuTe DSL MoE, gated as FlashInfer gates them."""
    import torch

    from conformance._framework.selection import flashinfer_platform
    from conformance._framework.tiers import device_for_tier

    platform = flashinfer_platform()
    module, reason = platform.load()
    if module is None:
        pytest.skip(reason)
    device = torch.device(device_for_tier("b200"))
    gpu = platform.gpu(device)
    if isinstance(gpu, str):
        pytest.skip(gpu)
    reason = platform.gemm_skip_reason("cute-dsl", device)
    if kind == "moe":
        reason = reason or platform.moe_skip_reason(device)
    if reason:
        pytest.skip(reason)
    return platform
