"""Where the FlashInfer backends run, behind one small interface
(:class:`conformance.interfaces.flashinfer_platform.FlashInferPlatform`):

* :class:`InstalledFlashInfer`: the installed ``flashinfer`` on this machine's CUDA GPU (the ``b200`` tier);
* :class:`EmulatedFlashInfer`: ``reference_impl.flashinfer_emulator`` standing in for it on this host's device
  (CUDA when present, else the CPU), with the capability check answering the emulator's SM100. Selected by
  ``pytest --flashinfer-emulated``: the b200 code path rehearsed anywhere, never a B200 result.

:func:`current_platform` picks one from :func:`conformance.interfaces.hardware.b200_emulated`. Every precondition
is a skip reason naming what was found and what is needed, checked the way FlashInfer 0.7.4 gates itself:

* the GPU's compute capability, by FlashInfer's own ``mm_bf16_fp4.is_backend_supported(backend, cc)`` /
  ``CuteDslMoEWrapper.__init__.is_compute_capability_supported(cc)``;
* ``cudnn``: the cuDNN Python frontend importable and ``cudnn.backend_version() >= 92301`` (9.23.1), the
  constant ``_CUDNN_BF16_FP4_MIN_BACKEND_VERSION`` of ``flashinfer/gemm/gemm_bf16_fp4.py``, below which its
  ``tests/gemm/test_mm_bf16_fp4.py`` skips the backend (``_skip_if_backend_unavailable``) and its requirement
  check raises; frontend >= 1.13 (``gemm_base._check_cudnn_fp4_availability``);
* ``cute-dsl`` (dense) and the CuTe DSL MoE: ``flashinfer.cute_dsl.is_cute_dsl_available()`` (the
  ``cute_dsl_available`` skip of ``tests/moe/test_cute_dsl_fused_moe.py``, ``_check_cute_dsl_availability`` of
  the dense requirement); for the MoE also ``is_cute_dsl_arch_supported(major, minor, native_only=True)``
  (that test file's ``_requires_dsl_arch``).
"""
from __future__ import annotations

import inspect
import re
from types import ModuleType
from typing import Any

import torch

from reference_impl.format.nvfp4 import W13_CHUNK_ROWS
from conformance.interfaces.flashinfer_platform import FlashInferPlatform
from conformance.interfaces.hardware import Gpu, b200_emulated

#: FlashInfer 0.7.4's minimum cuDNN backend version for BF16 x FP4 (used when the installed FlashInfer
#: does not expose ``gemm_bf16_fp4._CUDNN_BF16_FP4_MIN_BACKEND_VERSION``).
CUDNN_BF16_FP4_MIN_BACKEND_VERSION = 92301
#: ``gemm_base._check_cudnn_fp4_availability``: the cuDNN frontend must be 1.13 or newer for FP4.
CUDNN_MIN_FRONTEND = (1, 13)


#: The first FlashInfer release with ``prepare_bf16_fp4_weights`` / ``mm_bf16_fp4``.
REQUIRED_VERSION = "0.6.18"


def _version_tuple(version: str) -> tuple[int, int, int]:
    m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    if not m:
        raise ValueError(f"unparseable FlashInfer version {version!r}")
    return int(m[1]), int(m[2]), int(m[3] or 0)


def load_flashinfer() -> tuple[ModuleType | None, str | None]:
    """``(module, None)`` when a usable FlashInfer is installed, else ``(None, reason)``."""
    need = f"the flashinfer backend needs flashinfer-python>={REQUIRED_VERSION}"
    try:
        import flashinfer
    except ImportError as exc:
        return None, f"FlashInfer is not installed ({exc}); {need} (pip install 'flashinfer-python>={REQUIRED_VERSION}')"
    except Exception as exc:  # noqa: BLE001 - a broken install is reported verbatim, not raised mid-collection
        return None, f"FlashInfer failed to import ({type(exc).__name__}: {exc}); {need}"
    version = str(getattr(flashinfer, "__version__", "0"))
    try:
        too_old = _version_tuple(version) < _version_tuple(REQUIRED_VERSION)
    except ValueError as exc:
        return None, f"{exc}; {need}"
    if too_old:
        return None, f"flashinfer-python {version} is older than {REQUIRED_VERSION}, which added mm_bf16_fp4; {need}"
    missing = [f for f in ("prepare_bf16_fp4_weights", "mm_bf16_fp4") if not hasattr(flashinfer, f)]
    if missing:
        return None, f"flashinfer-python {version} lacks {', '.join(missing)}; {need}"
    return flashinfer, None


def cudnn_version_text(backend_version: int) -> str:
    """``92301`` -> ``"9.23.1"`` (cuDNN encodes major * 10000 + minor * 100 + patch)."""
    return f"{backend_version // 10000}.{backend_version // 100 % 100}.{backend_version % 100}"


def cudnn_skip_reason(frontend: str | None, backend_version: int | None, minimum: int,
                      unavailable: str | None = None) -> str | None:
    """Why the ``cudnn`` GEMM backend cannot run with this cuDNN (``None``: it can)."""
    need = f"needs cuDNN backend >= {cudnn_version_text(minimum)} ({minimum}) and frontend >= 1.13"
    if unavailable:
        return f"flashinfer mm_bf16_fp4 backend 'cudnn' {need}; {unavailable}"
    try:
        front = tuple(int(p) for p in str(frontend).split(".")[:2])
    except ValueError:
        return f"flashinfer mm_bf16_fp4 backend 'cudnn' {need}; unreadable cuDNN frontend version {frontend!r}"
    if front < CUDNN_MIN_FRONTEND:
        return f"flashinfer mm_bf16_fp4 backend 'cudnn' {need}; found frontend {frontend}"
    if backend_version is None or backend_version < minimum:
        found = "none" if backend_version is None else f"{cudnn_version_text(backend_version)} ({backend_version})"
        return f"flashinfer mm_bf16_fp4 backend 'cudnn' {need}; found backend {found}"
    return None


SUPPORTED_CAPABILITIES = ((10, 0), (10, 3), (10, 7))


# ------------------------------------------------------------------------------------------------ gates
def capability_skip_reason(mm_bf16_fp4: Any, gemm_backend: str, capability: tuple[int, int], gpu: str) -> str | None:
    """FlashInfer's verdict on ``gemm_backend`` at ``capability``, as a skip reason (``None``: supported)."""
    cc = capability[0] * 10 + capability[1]
    if mm_bf16_fp4.is_backend_supported(gemm_backend, cc):
        return None
    return f"flashinfer mm_bf16_fp4 backend '{gemm_backend}' does not support SM{cc} ({gpu})"


def precondition_skip_reason(gemm_backend: str, platform: FlashInferPlatform) -> str | None:
    """What ``gemm_backend`` needs besides the capability (cuDNN for ``cudnn``, the CuTe DSL for ``cute-dsl``),
    as a skip reason naming what was found; ``None`` when it is there."""
    if gemm_backend == "cudnn":
        return cudnn_skip_reason(*platform.cudnn())
    if gemm_backend == "cute-dsl":
        problem = platform.cute_dsl_problem(None)
        return f"flashinfer mm_bf16_fp4 backend 'cute-dsl' {problem}" if problem else None
    return None


def flashinfer_moe_skip_reason(case: CaseInfo | None, device: torch.device | None = None,
                               platform: FlashInferPlatform | None = None) -> str | None:
    """Why FlashInfer's W4A16 MoE cannot run here (``None`` if it can): shape, device, import, version,
    capability (FlashInfer's own query), CuTe DSL availability; ``platform`` defaults to the current one
    (the emulator under ``--flashinfer-emulated``)."""
    platform = platform or current_platform()
    device = torch.device(device if device is not None else (case.device if case else "cuda"))
    if case is not None:
        inter = case.shape.get("intermediate", 0)
        if case.features & {"swiglu", "geglu", "swiglu_oai"} and inter % W13_CHUNK_ROWS:
            return f"gated W13 needs intermediate % {W13_CHUNK_ROWS} == 0 for the 64-row interleave, got {inter}"
        if "untied_gate_up_general" in case.features:
            return (
                "gate/up decode scales differ by a non-power-of-two ratio: CuteDslMoEWrapper takes one GEMM1 "
                "alpha per expert and no exact fold exists (see flashinfer_moe.fold_gate_up_scales)"
            )
    gpu = platform.gpu(device)
    if isinstance(gpu, str):
        return f"FlashInfer CuTe DSL W4A16 MoE (SM100/SM103/SM107): {gpu}"
    module, reason = platform.load()
    if module is None:
        return reason
    version = getattr(module, "__version__", "unknown")
    try:
        wrapper_cls, _ = platform.moe_wrapper()
    except Exception as exc:  # noqa: BLE001 - any import failure is a reason to skip, reported verbatim
        return f"flashinfer {version}: CuteDslMoEWrapper not importable ({type(exc).__name__}: {exc})"
    if "quant_mode" not in inspect.signature(wrapper_cls.__init__).parameters:
        return f"flashinfer {version}: CuteDslMoEWrapper has no quant_mode (W4A16 MoE needs FlashInfer >= 0.7)"
    cap = gpu.capability
    query = getattr(wrapper_cls.__init__, "is_compute_capability_supported", None)
    supported = query(cap[0] * 10 + cap[1]) if query else cap in SUPPORTED_CAPABILITIES
    if not supported:
        return (
            f"CuteDslMoEWrapper supports SM100/SM103/SM107 (flashinfer {version}), "
            f"found SM{cap[0]}{cap[1]} ({gpu.name})"
        )
    problem = platform.cute_dsl_problem(cap)
    return f"FlashInfer CuTe DSL W4A16 MoE {problem}" if problem else None


class AdapterPlatform(FlashInferPlatform):
    """The gates both platforms answer the same way, from the adapter's own checks (kernel.py, moe.py)."""

    def gemm_skip_reason(self, gemm_backend: str, device: torch.device | str) -> str | None:
        module, reason = self.load()
        if module is None:
            return reason
        gpu = self.gpu(torch.device(device))
        if isinstance(gpu, str):
            return gpu
        return (capability_skip_reason(module.mm_bf16_fp4, gemm_backend, gpu.capability, gpu.name)
                or precondition_skip_reason(gemm_backend, self))

    def moe_skip_reason(self, device: torch.device | str) -> str | None:
        return flashinfer_moe_skip_reason(None, torch.device(device), self)


class InstalledFlashInfer(AdapterPlatform):
    """The installed FlashInfer on this machine's CUDA GPUs."""

    def load(self) -> tuple[Any, str | None]:
        return load_flashinfer()

    def describe(self, module: Any) -> str:
        return f"flashinfer {getattr(module, '__version__', 'unknown')}"

    def gpu(self, device: torch.device) -> Gpu | str:
        device = torch.device(device)
        if device.type != "cuda":
            return f"FlashInfer runs on CUDA GPUs only; this case runs on {device.type}"
        if not torch.cuda.is_available():
            return "FlashInfer needs a CUDA GPU; torch.cuda.is_available() is False"
        return Gpu(torch.cuda.get_device_name(device), tuple(torch.cuda.get_device_capability(device)))

    def cudnn(self) -> tuple[str | None, int | None, int, str | None]:
        minimum = CUDNN_BF16_FP4_MIN_BACKEND_VERSION
        try:
            from flashinfer.gemm import gemm_bf16_fp4

            minimum = int(getattr(gemm_bf16_fp4, "_CUDNN_BF16_FP4_MIN_BACKEND_VERSION", minimum))
            import cudnn
        except Exception as exc:  # noqa: BLE001 - any import failure means: no usable cuDNN frontend
            return None, None, minimum, f"the cuDNN Python frontend is not importable ({type(exc).__name__}: {exc})"
        try:
            return str(cudnn.__version__), int(cudnn.backend_version()), minimum, None
        except Exception as exc:  # noqa: BLE001
            return None, None, minimum, f"cudnn.backend_version() failed ({type(exc).__name__}: {exc})"

    def cute_dsl_problem(self, capability: tuple[int, int] | None) -> str | None:
        try:
            from flashinfer.cute_dsl import is_cute_dsl_arch_supported, is_cute_dsl_available
        except Exception as exc:  # noqa: BLE001
            return f"flashinfer.cute_dsl is not importable ({type(exc).__name__}: {exc})"
        if not is_cute_dsl_available():
            return "needs the CuTe DSL (nvidia-cutlass-dsl): flashinfer.cute_dsl.is_cute_dsl_available() is False"
        if capability is not None and not is_cute_dsl_arch_supported(*capability, native_only=True):
            return (f"the installed CuTe DSL cannot target SM{capability[0]}{capability[1]} natively "
                    f"(is_cute_dsl_arch_supported(..., native_only=True) is False)")
        return None

    def cute_dsl_gemm_shape_problem(self, m: int, n: int, k: int, capability: tuple[int, int]) -> str | None:
        # FlashInfer 0.7.4 (gemm_bf16_fp4_cute_dsl.py) picks among _SM100_BF16_FP4_TACTICS those whose
        # Sm100DenseGemmBf16Fp4Kernel.can_implement(mnkl=(n, m, k, 1), ...) holds (the kernel's M mode carries
        # the output channels); its own tests use only N, K multiples of 64, so odd shapes must be asked.
        if capability not in ((10, 0), (10, 3), (10, 7)):
            return None  # other architectures run another kernel family, which states no such check
        try:
            import cutlass
            from flashinfer.gemm import gemm_bf16_fp4_cute_dsl as chooser
            from flashinfer.gemm.kernels.cute_dsl.dense_gemm_bf16_fp4_sm100 import Sm100DenseGemmBf16Fp4Kernel
            tactics = chooser._SM100_BF16_FP4_TACTICS
        except Exception:  # noqa: BLE001 - without these the availability gate (cute_dsl_problem) decides
            return None
        return cute_dsl_tactics_problem(Sm100DenseGemmBf16Fp4Kernel.can_implement, tactics, cutlass, m, n, k)

    def moe_wrapper(self) -> tuple[type, Any]:
        from flashinfer.fused_moe.cute_dsl.fused_moe import CuteDslMoEWrapper
        from flashinfer.tllm_enums import ActivationType

        return CuteDslMoEWrapper, ActivationType

    def module_tree(self) -> dict[str, ModuleType]:
        import sys

        import flashinfer  # noqa: F401 - the real package and the submodules it imported
        import flashinfer.cute_dsl.utils  # noqa: F401 - imported at call time by engines

        return {k: m for k, m in sys.modules.items() if (k == "flashinfer" or k.startswith("flashinfer.")) and m}


class EmulatedFlashInfer(AdapterPlatform):
    """``reference_impl.flashinfer_emulator`` in FlashInfer's place (``--flashinfer-emulated``)."""

    emulated = True

    def load(self) -> tuple[Any, str | None]:
        import reference_impl.flashinfer_emulator as emulator

        return emulator, None

    def describe(self, module: Any) -> str:
        return (f"flashinfer_emulator {getattr(module, '__version__', '?')} standing in for FlashInfer "
                f"(--flashinfer-emulated: not a B200 result)")

    def gpu(self, device: torch.device) -> Gpu | str:
        from reference_impl.flashinfer_emulator._device import current_major_minor

        device = torch.device(device)
        if device.type == "cuda" and not torch.cuda.is_available():
            return "the emulated FlashInfer was given a CUDA case but torch.cuda.is_available() is False"
        return Gpu(f"emulated by flashinfer_emulator on {device.type}", current_major_minor())

    def cudnn(self) -> tuple[str | None, int | None, int, str | None]:
        # The emulated machine has the cuDNN FlashInfer asks for; the gate itself still runs.
        return "1.13", CUDNN_BF16_FP4_MIN_BACKEND_VERSION, CUDNN_BF16_FP4_MIN_BACKEND_VERSION, None

    def cute_dsl_problem(self, capability: tuple[int, int] | None) -> str | None:
        return None

    def moe_wrapper(self) -> tuple[type, Any]:
        import reference_impl.flashinfer_emulator as emulator

        return emulator.CuteDslMoEWrapper, emulator.ActivationType

    def module_tree(self) -> dict[str, ModuleType]:
        from reference_impl.flashinfer_emulator import flashinfer_module_tree

        return flashinfer_module_tree()


def cute_dsl_tactics_problem(can_implement: Any, tactics: Any, cutlass: Any, m: int, n: int, k: int) -> str | None:
    """``None`` when some ``(mma_tiler, cluster_shape, ...)`` tactic passes FlashInfer's ``can_implement``
    for ``M x N x K``, else the skip reason."""
    for tactic in tactics:
        mma_tiler, cluster_shape = tactic[0], tactic[1]
        if can_implement(mnkl=(n, m, k, 1), a_dtype=cutlass.Float4E2M1FN, b_dtype=cutlass.BFloat16,
                         c_dtype=cutlass.BFloat16, a_major="k", b_major="k", c_major="m", mma_tiler=mma_tiler,
                         cluster_shape_mn=cluster_shape, use_2cta_instrs=mma_tiler[0] == 256):
            return None
    return (f"flashinfer mm_bf16_fp4 backend 'cute-dsl' has no kernel tactic for M={m}, N={n}, K={k} "
            f"(Sm100DenseGemmBf16Fp4Kernel.can_implement is False for all {len(tuple(tactics))} tactics)")


def current_platform(installed: bool = False) -> FlashInferPlatform:
    """The emulator under ``--flashinfer-emulated`` (:func:`conformance.interfaces.hardware.b200_emulated`), else (or
    when ``installed``) the installed FlashInfer. The selection table's ``flashinfer_platform`` of ``flashinfer``."""
    return EmulatedFlashInfer() if b200_emulated() and not installed else InstalledFlashInfer()
