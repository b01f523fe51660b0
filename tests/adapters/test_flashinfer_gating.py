"""The flashinfer backend's gating, on CPU: FlashInfer's own capability query decides (SM90 vs SM100...), the
preconditions FlashInfer's own tests check (cuDNN >= 9.23.1 for ``cudnn``, the CuTe DSL for ``cute-dsl``) skip
with what was found and what is needed, a missing or too old FlashInfer skips with a reason naming the required
version, and the adapter's plumbing (swizzle, alpha, AWQ, bias, leading dims) is right when driven through an
emulation of FlashInfer's API."""
from __future__ import annotations

import sys

import pytest
import torch

from conformance.interfaces.kernel import CaseInfo
from conformance.backends import load_backends
from conformance.adapters.flashinfer import kernel as fi_backend
from conformance.adapters.flashinfer.kernel import (
    KNOWN_GEMM_BACKENDS,
    REQUIRED_VERSION,
    FlashInferBackend,
    all_backends,
    capability_skip_reason,
    shape_skip_reason,
)
from conformance.adapters.flashinfer.platform import (
    CUDNN_BF16_FP4_MIN_BACKEND_VERSION,
    EmulatedFlashInfer,
    InstalledFlashInfer,
    cudnn_skip_reason,
    cute_dsl_tactics_problem,
)
from conformance.testing import Gpu
from conformance.dense.checks import failing_checks
from conformance.dense.cases import CPU_CASES, DENSE_CASES

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


class FakeMachine(InstalledFlashInfer):
    """The installed FlashInfer on a made-up GPU with a made-up cuDNN and CuTe DSL (nothing touches CUDA)."""

    def __init__(self, gpu, cudnn=("1.16.0", 92400), cute_dsl=None):
        self._gpu, self._cudnn, self._cute_dsl = Gpu(gpu[1], gpu[0]), cudnn, cute_dsl

    def gpu(self, device):
        return self._gpu

    def cudnn(self):
        return (*self._cudnn, CUDNN_BF16_FP4_MIN_BACKEND_VERSION, None)

    def cute_dsl_problem(self, capability):
        return self._cute_dsl


def test_one_backend_per_flashinfer_gemm_backend():
    names = [b.name for b in all_backends()]
    assert names and all(n.startswith("flashinfer-") for n in names)
    if flashinfer.__version__ == "0.7.4":
        assert names == [f"flashinfer-{b}" for b in KNOWN_GEMM_BACKENDS]
    assert [b.name for b in load_backends("flashinfer")] == names


@pytest.mark.parametrize("gemm_backend,gpu,expected", GATING, ids=[f"{g[0]}-{g[1][1]}" for g in GATING])
def test_capability_gating_follows_flashinfer(gemm_backend, gpu, expected):
    if flashinfer.__version__ != "0.7.4":
        pytest.skip(f"table written for FlashInfer 0.7.4, installed {flashinfer.__version__}")
    assert capability_skip_reason(flashinfer.mm_bf16_fp4, gemm_backend, *gpu) == expected
    backend = FlashInferBackend(gemm_backend, flashinfer, platform=FakeMachine(gpu))
    assert backend.skip_reason(CUDA_CASE.info()) == expected


@pytest.mark.parametrize("cc", [80, 90, 100, 103, 107, 110, 120, 121])
def test_verdict_is_flashinfers_own_query(cc):
    for backend in all_backends():
        supported = flashinfer.mm_bf16_fp4.is_backend_supported(backend.gemm_backend, cc)
        reason = capability_skip_reason(flashinfer.mm_bf16_fp4, backend.gemm_backend, (cc // 10, cc % 10), "gpu")
        assert (reason is None) == supported, (backend.name, cc, reason)


def test_cpu_case_and_missing_cuda_are_precise_reasons(monkeypatch):
    backend = FlashInferBackend("cute-dsl", flashinfer, platform=InstalledFlashInfer())
    assert backend.skip_reason(CPU_CASES[0].info()) == "FlashInfer runs on CUDA GPUs only; this case runs on cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert backend.skip_reason(CUDA_CASE.info()) == "FlashInfer needs a CUDA GPU; torch.cuda.is_available() is False"


# (frontend, backend version, expected reason fragment or None): FlashInfer 0.7.4 gates cudnn at 92301 (9.23.1).
CUDNN = [
    (("1.16.0", 92301), None),
    (("1.16.0", 92400), None),
    (("1.16.0", 92300), "found backend 9.23.0 (92300)"),
    (("1.14.0", 91002), "found backend 9.10.2 (91002)"),
    (("1.12.0", 92400), "found frontend 1.12.0"),
]


@pytest.mark.parametrize("cudnn,expected", CUDNN, ids=[f"{c[0][0]}-{c[0][1]}" for c in CUDNN])
def test_cudnn_backend_gated_like_flashinfers_own_tests(cudnn, expected):
    """tests/gemm/test_mm_bf16_fp4.py skips cudnn below _CUDNN_BF16_FP4_MIN_BACKEND_VERSION; so does the suite,
    naming what was found and what is needed. The other backends do not depend on cuDNN."""
    reason = FlashInferBackend("cudnn", flashinfer, platform=FakeMachine(B200, cudnn=cudnn)).skip_reason(CUDA_CASE.info())
    if expected is None:
        assert reason is None
    else:
        assert expected in reason and "needs cuDNN backend >= 9.23.1 (92301)" in reason, reason
    other = FlashInferBackend("blackwell-native", flashinfer, platform=FakeMachine(B200, cudnn=cudnn))
    assert other.skip_reason(CUDA_CASE.info()) is None


def test_cudnn_minimum_is_flashinfers_own_constant():
    from flashinfer.gemm import gemm_bf16_fp4

    assert InstalledFlashInfer().cudnn()[2] == gemm_bf16_fp4._CUDNN_BF16_FP4_MIN_BACKEND_VERSION
    if flashinfer.__version__ == "0.7.4":
        assert CUDNN_BF16_FP4_MIN_BACKEND_VERSION == gemm_bf16_fp4._CUDNN_BF16_FP4_MIN_BACKEND_VERSION == 92301


def test_missing_cudnn_and_cute_dsl_are_skips_with_reasons():
    """On this machine neither the cuDNN frontend nor the CuTe DSL is installed: both are reasons, not errors."""
    frontend, version, minimum, unavailable = InstalledFlashInfer().cudnn()
    reason = cudnn_skip_reason(frontend, version, minimum, unavailable)
    assert reason is None or "needs cuDNN backend >= 9.23.1" in reason
    missing_dsl = FakeMachine(B200, cute_dsl="needs the CuTe DSL (nvidia-cutlass-dsl): is_cute_dsl_available() is False")
    reason = FlashInferBackend("cute-dsl", flashinfer, platform=missing_dsl).skip_reason(CUDA_CASE.info())
    assert reason == "flashinfer mm_bf16_fp4 backend 'cute-dsl' needs the CuTe DSL (nvidia-cutlass-dsl): is_cute_dsl_available() is False"


def test_blackwell_tiled_declines_n_not_multiple_of_64():
    info = CaseInfo("dense", torch.device("cuda"), {"m": 7, "n": 200, "k": 80})
    assert FlashInferBackend("blackwell-tiled", flashinfer, platform=FakeMachine(B200)).skip_reason(info) == (
        "blackwell-tiled requires N % 64 == 0 (FlashInfer 0.7.4); case has N=200, K=80"
    )
    assert FlashInferBackend("blackwell-native", flashinfer, platform=FakeMachine(B200)).skip_reason(info) is None


def test_cute_dsl_shape_gate_asks_flashinfers_kernel_for_every_tactic():
    """cute-dsl on SM100: a shape skips only when FlashInfer's own ``can_implement`` rejects every tactic
    (here a stand-in kernel that needs K % 64 == 0); the arguments are the ones FlashInfer's chooser passes."""
    seen = []

    def can_implement(*, mnkl, mma_tiler, **kw):
        seen.append((mnkl, mma_tiler, kw["use_2cta_instrs"], kw["c_major"]))
        return mnkl[2] % 64 == 0 and mma_tiler[0] == 256

    cutlass = type("cutlass", (), {"Float4E2M1FN": "fp4", "BFloat16": "bf16"})
    tactics = (((128, 64, 128), (1, 1), None), ((256, 64, 128), (2, 1), None))
    assert cute_dsl_tactics_problem(can_implement, tactics, cutlass, 7, 96, 128) is None
    assert seen[-1] == ((96, 7, 128, 1), (256, 64, 128), True, "m")  # (N, M, K): the kernel's M is the output
    reason = cute_dsl_tactics_problem(can_implement, tactics, cutlass, 7, 96, 80)
    assert reason == ("flashinfer mm_bf16_fp4 backend 'cute-dsl' has no kernel tactic for M=7, N=96, K=80 "
                      "(Sm100DenseGemmBf16Fp4Kernel.can_implement is False for all 2 tactics)")

    class NoKernelForOddK(FakeMachine):
        def cute_dsl_gemm_shape_problem(self, m, n, k, capability):
            return None if k % 64 == 0 else f"no tactic for K={k}"

    info = CaseInfo("dense", torch.device("cuda"), {"m": 7, "n": 96, "k": 80})
    assert FlashInferBackend("cute-dsl", flashinfer, platform=NoKernelForOddK(B200)).skip_reason(info) == "no tactic for K=80"
    assert FlashInferBackend("cudnn", flashinfer, platform=NoKernelForOddK(B200)).skip_reason(info) is None
    # Without the CUTLASS DSL (this machine) or off SM100 the installed platform cannot tell: no skip from it.
    assert InstalledFlashInfer().cute_dsl_gemm_shape_problem(7, 96, 80, (9, 0)) is None


def test_emulated_platform_answers_sm100_and_runs_the_same_gates():
    """``--flashinfer-emulated``: the emulator's mm_bf16_fp4 answers FlashInfer's queries, the capability is
    SM100, cuDNN and the CuTe DSL are present, and the backends are named as on a B200 (same test ids)."""
    import reference_impl.flashinfer_emulator as emulator

    platform = EmulatedFlashInfer()
    module, reason = platform.load()
    assert module is emulator and reason is None
    names = fi_backend.offered_gemm_backends(module.mm_bf16_fp4)
    assert names == KNOWN_GEMM_BACKENDS
    cpu_case = CPU_CASES[0].info()
    verdicts = {n: FlashInferBackend(n, module, platform=platform).skip_reason(cpu_case) for n in names}
    assert verdicts["cute-dsl-native"] == (
        "flashinfer mm_bf16_fp4 backend 'cute-dsl-native' does not support SM100 (emulated by flashinfer_emulator on cpu)"
    )
    assert verdicts["cudnn"] is None and verdicts["cute-dsl"] is None and verdicts["blackwell-native"] is None
    assert "not a B200 result" in FlashInferBackend("cudnn", module, platform=platform).version()


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
    platform = InstalledFlashInfer()
    assert "exercised once, under flashinfer-cute-dsl" in FlashInferBackend("cudnn", flashinfer, platform=platform).skip_reason(info)
    reason = FlashInferBackend("cute-dsl", flashinfer, platform=platform).skip_reason(info)
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
