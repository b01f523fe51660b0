"""The ``vllm`` rules engine: vLLM 0.32's own NVFP4 W4A16 kernel selection, imported and called on a CPU host.

What is called (looked up on vLLM's modules at call time, so a monkeypatched vLLM function is what runs):

- ``vllm_linear``: ``vllm.model_executor.kernels.linear.init_nvfp4_linear_kernel(use_a16=True)`` (what
  ``ModelOptLinearMethod.create_weights`` reaches for a ``W4A16_NVFP4`` layer through ``select_linear_kernel``)
  under ``VLLM_BATCH_INVARIANT`` and a ``VllmConfig`` whose ``kernel_config.linear_backend`` is the case's
  ``--linear-backend``; the answer is the kernel class it instantiates, or the ValueError it raises.
- ``vllm_moe``: ``fused_moe.oracle.nvfp4.select_nvfp4_moe_backend`` with ``activation_key=None`` (what
  ``ModelOptNvFp4FusedMoE.__init__`` passes for a ``W4A16_NVFP4`` checkpoint) on a SwiGLU layer config whose
  ``moe_backend`` is the case's ``--moe-backend``.

The platform is stood in by :func:`conformance.adapters.vllm._import.emulated_platform` (CUDA, the case's compute
capability); the probes that ask for compiled or optional packages are answered by the case's machine (see
``reference_impl/rules/vllm.py``): CUTLASS FP4 compiled (``cutlass_scaled_mm_supports_fp4``: SM100 and newer),
FlashInfer's CuTe DSL W4A16 GEMM present (``has_flashinfer_bf16_fp4``), ``humming`` installed or not
(``has_humming``). Everything else (the b12x package, the experts' device checks) is vLLM's own answer.
The SGLang-shaped matrices (SGLang env flags, A2A dispatch, ...) have no vLLM counterpart: this engine reports
them unsupported, and the ``vllm-0.32`` profile does not model them.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

from conformance.interfaces.rules import Inputs, RulesEngine
from conformance.adapters.vllm._import import VLLMUnavailable, emulated_platform, import_vllm, vllm_version

VLLM_MATRICES = ("vllm_linear", "vllm_moe")


@contextlib.contextmanager
def _machine(inputs: Inputs) -> Iterator[None]:
    """The case's GPU and packages, and ``VLLM_BATCH_INVARIANT``; all restored afterwards."""
    import vllm.model_executor.kernels.linear.nvfp4.flashinfer as fi_kernels
    import vllm.model_executor.kernels.linear.nvfp4.humming as humming_kernel
    import vllm.model_executor.layers.fused_moe.experts.fused_humming_moe as humming_moe
    from vllm.model_executor.layers.quantization.utils import nvfp4_utils

    installed = inputs.get("humming") == "installed"
    patches = [
        (nvfp4_utils, "cutlass_scaled_mm_supports_fp4", lambda cc: cc >= 100),
        (fi_kernels, "has_flashinfer_bf16_fp4", lambda: True),
        (humming_kernel, "has_humming", lambda: installed),
        (humming_moe, "has_humming", lambda: installed),
    ]
    saved_env = os.environ.get("VLLM_BATCH_INVARIANT")
    saved = [(m, n, getattr(m, n)) for m, n, _ in patches]
    try:
        for m, n, v in patches:
            setattr(m, n, v)
        os.environ["VLLM_BATCH_INVARIANT"] = inputs.get("batch_invariant", "0")
        with emulated_platform(int(inputs["platform"].removeprefix("sm")), name="rules case"):
            yield
    finally:
        for m, n, v in reversed(saved):
            setattr(m, n, v)
        if saved_env is None:
            os.environ.pop("VLLM_BATCH_INVARIANT", None)
        else:
            os.environ["VLLM_BATCH_INVARIANT"] = saved_env


def _humming_importable() -> bool:
    try:
        import humming.config.config  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means vLLM cannot ask it
        return False
    return True


class VLLMRules(RulesEngine):
    name = "vllm"
    default_profile = "vllm-0.32"

    def __init__(self) -> None:
        import_vllm()

    def version(self) -> str:
        return vllm_version()

    def unsupported(self, matrix: str, inputs: Inputs) -> str | None:
        if matrix not in VLLM_MATRICES:
            return (f"matrix {matrix} asks SGLang's rules (its env flags, runners, A2A backends): vLLM has no "
                    f"counterpart; the vllm engine answers {', '.join(VLLM_MATRICES)}")
        # vLLM asks the Humming experts only for --moe-backend humming, or under auto where Humming outranks
        # Marlin (SM90: prioritize_humming); elsewhere a backend ahead of it answers first
        asks_humming = inputs.get("moe_backend") == "humming" or (
            inputs.get("moe_backend") == "auto" and inputs.get("platform") == "sm90")
        if (matrix == "vllm_moe" and inputs.get("humming") == "installed" and asks_humming
                and not _humming_importable()):
            return ("vLLM's Humming MoE experts ask the humming package itself (fused_humming_moe."
                    "is_supported_config imports humming.config), and humming-kernels needs cuda-bindings: not "
                    "importable on this host")
        return super().unsupported(matrix, inputs)

    # ---- vLLM's own decisions ---------------------------------------------------------------------------
    def vllm_linear_kernel(self, inputs: Inputs) -> dict[str, Any]:
        from vllm.config import VllmConfig, set_current_vllm_config
        from vllm.model_executor import kernels

        config = VllmConfig()
        config.kernel_config.linear_backend = inputs["linear_backend"]
        with _machine(inputs), set_current_vllm_config(config):
            kernel = kernels.linear.init_nvfp4_linear_kernel(use_a16=True)
        return {"kernel": type(kernel).__name__}

    def vllm_moe_backend(self, inputs: Inputs) -> dict[str, Any]:
        from conformance.adapters.vllm.rules_moe import select_backend

        with _machine(inputs):
            return {"backend": select_backend(inputs["moe_backend"], use_a16=True)["backend"]}

    # ---- SGLang-shaped questions: no vLLM counterpart (reported unsupported above) ---------------------------
    def _no_counterpart(self, *_args, **_kwargs):
        raise NotImplementedError("vLLM has no counterpart of this SGLang rule")

    resolve_dense = fp4_gemm_dispatch = resolve_moe = validate_a2a = fusion_enabled = _no_counterpart
    lm_head_guard = reload_param = _no_counterpart


def load() -> VLLMRules:
    """Factory used by the engine selector; raises VLLMUnavailable if vLLM cannot be imported."""
    return VLLMRules()


__all__ = ["VLLMRules", "VLLMUnavailable", "load"]
