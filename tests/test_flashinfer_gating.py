"""The flashinfer backend's gating, on CPU: FlashInfer's own capability query decides (SM90 vs SM100...),
a missing or too old FlashInfer skips with a reason naming the required version, and the adapter's plumbing
(swizzle, alpha, AWQ, bias, leading dims) is right when driven through an emulation of FlashInfer's API."""
from __future__ import annotations

import sys

import pytest
import torch

from conformance.adapter import CaseInfo
from conformance.backends import load_backends
from conformance.backends import flashinfer as fi_backend
from conformance.backends.flashinfer import (
    KNOWN_GEMM_BACKENDS,
    REQUIRED_VERSION,
    FlashInferBackend,
    all_backends,
    capability_skip_reason,
    shape_skip_reason,
)
from conformance.checks_dense import failing_checks
from conformance.dense_cases import CPU_CASES, DENSE_CASES

flashinfer = pytest.importorskip("flashinfer", reason="the gating is tested through an installed FlashInfer")

H200, B200, B300, RTX = ((9, 0), "NVIDIA H200"), ((10, 0), "NVIDIA B200"), ((10, 3), "NVIDIA B300"), ((12, 0), "RTX PRO 6000")
# (gemm backend, gpu, expected skip reason or None): what FlashInfer 0.7.4's own decorators declare.
GATING = [
    ("cudnn", H200, "flashinfer mm_bf16_fp4 backend 'cudnn' does not support SM90 (NVIDIA H200)"),
    ("cudnn", B200, None),
    ("cute-dsl", H200, "flashinfer mm_bf16_fp4 backend 'cute-dsl' does not support SM90 (NVIDIA H200)"),
    ("cute-dsl", B300, None),
    ("cute-dsl-native", B200, "flashinfer mm_bf16_fp4 backend 'cute-dsl-native' does not support SM100 (NVIDIA B200)"),
    ("cute-dsl-native", RTX, None),
    ("blackwell-native", B200, None),
    ("blackwell-native", RTX, "flashinfer mm_bf16_fp4 backend 'blackwell-native' does not support SM120 (RTX PRO 6000)"),
    ("blackwell-tiled", H200, "flashinfer mm_bf16_fp4 backend 'blackwell-tiled' does not support SM90 (NVIDIA H200)"),
]
CUDA_CASE = next(c for c in DENSE_CASES if c.tier == "cuda")


@pytest.fixture
def fake_gpu(monkeypatch):
    """Make torch report one GPU of the given (capability, name), without touching CUDA."""

    def install(gpu):
        capability, name = gpu
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)

    return install


def test_one_backend_per_flashinfer_gemm_backend():
    names = [b.name for b in all_backends()]
    assert names and all(n.startswith("flashinfer-") for n in names)
    if flashinfer.__version__ == "0.7.4":
        assert names == [f"flashinfer-{b}" for b in KNOWN_GEMM_BACKENDS]
    assert [b.name for b in load_backends("flashinfer")] == names


@pytest.mark.parametrize("gemm_backend,gpu,expected", GATING, ids=[f"{g[0]}-{g[1][1]}" for g in GATING])
def test_capability_gating_follows_flashinfer(gemm_backend, gpu, expected, fake_gpu):
    if flashinfer.__version__ != "0.7.4":
        pytest.skip(f"table written for FlashInfer 0.7.4, installed {flashinfer.__version__}")
    assert capability_skip_reason(flashinfer.mm_bf16_fp4, gemm_backend, *gpu) == expected
    fake_gpu(gpu)
    assert FlashInferBackend(gemm_backend, flashinfer).skip_reason(CUDA_CASE.info()) == expected


@pytest.mark.parametrize("cc", [80, 90, 100, 103, 107, 110, 120, 121])
def test_verdict_is_flashinfers_own_query(cc):
    for backend in all_backends():
        supported = flashinfer.mm_bf16_fp4.is_backend_supported(backend.gemm_backend, cc)
        reason = capability_skip_reason(flashinfer.mm_bf16_fp4, backend.gemm_backend, (cc // 10, cc % 10), "gpu")
        assert (reason is None) == supported, (backend.name, cc, reason)


def test_cpu_case_and_missing_cuda_are_precise_reasons(monkeypatch):
    backend = FlashInferBackend("cute-dsl", flashinfer)
    assert backend.skip_reason(CPU_CASES[0].info()) == "FlashInfer mm_bf16_fp4 runs on CUDA GPUs only; this case runs on cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert backend.skip_reason(CUDA_CASE.info()) == (
        "FlashInfer mm_bf16_fp4 needs a CUDA GPU; torch.cuda.is_available() is False"
    )


def test_blackwell_tiled_declines_n_not_multiple_of_64(fake_gpu):
    fake_gpu(B200)
    info = CaseInfo("dense", torch.device("cuda"), {"m": 7, "n": 200, "k": 80})
    assert FlashInferBackend("blackwell-tiled", flashinfer).skip_reason(info) == (
        "blackwell-tiled requires N % 64 == 0 (FlashInfer 0.7.4); case has N=200, K=80"
    )
    assert FlashInferBackend("blackwell-native", flashinfer).skip_reason(info) is None


@pytest.mark.parametrize("version", ["0.6.17", "0.5.3", "0.6.2"])
def test_too_old_flashinfer_skips_naming_the_required_version(version, monkeypatch):
    monkeypatch.setattr(flashinfer, "__version__", version)
    backends = load_backends("flashinfer")
    assert [b.name for b in backends] == ["flashinfer"]
    reason = backends[0].skip_reason(CUDA_CASE.info())
    assert f"flashinfer-python {version} is older than {REQUIRED_VERSION}" in reason
    assert f"flashinfer-python>={REQUIRED_VERSION}" in reason
    with pytest.raises(RuntimeError, match=REQUIRED_VERSION):
        backends[0].prepare_dense(None, torch.device("cpu"))


@pytest.mark.parametrize("version", [REQUIRED_VERSION, "0.6.18rc1", "0.7.4", "1.0.0"])
def test_new_enough_versions_are_accepted(version, monkeypatch):
    monkeypatch.setattr(flashinfer, "__version__", version)
    module, reason = fi_backend.load_flashinfer()
    assert module is flashinfer and reason is None


def test_missing_flashinfer_skips_naming_the_required_version(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # makes `import flashinfer` raise ImportError
    (backend,) = all_backends()
    reason = backend.skip_reason(CPU_CASES[0].info())
    assert reason.startswith("FlashInfer is not installed") and f"flashinfer-python>={REQUIRED_VERSION}" in reason


def test_moe_is_offered_once_and_delegated():
    info = CaseInfo("moe", torch.device("cpu"), {"tokens": 4, "experts": 2, "top_k": 1, "hidden": 128, "intermediate": 128})
    assert "exercised once, under flashinfer-cute-dsl" in FlashInferBackend("cudnn", flashinfer).skip_reason(info)
    reason = FlashInferBackend("cute-dsl", flashinfer).skip_reason(info)
    assert reason and "CUDA" in reason  # flashinfer_moe's own reason on a CPU case


PLUMBING_CASES = [c for c in CPU_CASES if c.id in (
    "cpu-awq-bias-3d", "cpu-fused-qkv-3-scales", "cpu-noncontiguous-3d", "cpu-k80-mult16-not64", "cpu-nonfinite-3d-bias",
)]


@pytest.mark.parametrize("gemm_backend", ["cudnn", "cute-dsl", "blackwell-native", "blackwell-tiled"])
def test_adapter_plumbing_through_emulated_flashinfer(gemm_backend):
    """The adapter's prepare/run, driven through reference_impl.flashinfer_emulator (FlashInfer 0.7.4's
    API in PyTorch, emulating SM100), passes every dense check: swizzled scales, alpha = max(weight_scale_2)
    without input_scale, AWQ in bf16, bias, 3-D and non-contiguous activations."""
    emulator = pytest.importorskip("reference_impl.flashinfer_emulator")
    backend = FlashInferBackend(gemm_backend, emulator)
    ran = 0
    for case in PLUMBING_CASES:
        if shape_skip_reason(gemm_backend, case.n, case.k):
            continue
        assert failing_checks(backend, case) == {}, case.id
        ran += 1
    assert ran >= 2
