"""FlashInfer's W4A16 dense GEMM behind the adapter: ``prepare_bf16_fp4_weights`` once per layer, then
``mm_bf16_fp4`` per call, one :class:`FlashInferBackend` per GEMM backend the installed FlashInfer offers
(``flashinfer-cudnn``, ``flashinfer-cute-dsl``, ... each its own parametrization).

What the adapter does around the two calls is what SGLang 0.5.23 does (``ModelOptFp4LinearMethod`` in
W4A16 mode): block scales 128x4-swizzled, ``alpha = max(weight_scale_2)`` as a ``(1,)`` fp32 tensor (the
W4A4 ``input_scale`` is never folded in), ``x * pre_quant_scale`` in bf16 before the GEMM, the GEMM on the
activations flattened to 2-D, the bias added to the bf16 output.

The backends need the ``b200`` tier (:attr:`FlashInferBackend.tier`): every case run against them is a
``b200`` test, on the platform's device. Gating is FlashInfer's own: the capability query
(``mm_bf16_fp4.is_backend_supported(backend, cc)``), then the preconditions its tests check (cuDNN version,
CuTe DSL availability: :mod:`conformance.adapters.flashinfer.platform`), each a skip naming what was found and
what is needed. FlashInfer missing, unimportable or older than :data:`REQUIRED_VERSION` does not abort the run:
one backend named ``flashinfer`` is returned whose every case skips with the reason (naming the version).
Under ``--flashinfer-emulated`` the same backends drive the emulator (:class:`~conformance.adapters.flashinfer.
platform.EmulatedFlashInfer`). Fused MoE is delegated to :mod:`conformance.adapters.flashinfer.moe`
and offered by one instance only (:data:`MOE_GEMM_BACKEND`), since it does not depend on the dense GEMM backend.
"""
from __future__ import annotations

import inspect
import typing
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from reference_impl.dense import dense_alpha
from reference_impl.format.nvfp4 import swizzle_128x4

from conformance.interfaces.kernel import Backend, CaseInfo, DenseLayer, MoEExperts
from conformance.adapters.flashinfer.platform import (  # noqa: F401 - load_flashinfer, REQUIRED_VERSION: public here too
    REQUIRED_VERSION,
    FlashInferPlatform,
    cudnn_skip_reason,
    current_platform,
    capability_skip_reason,
    load_flashinfer,
    precondition_skip_reason,
)

#: GEMM backends of FlashInfer 0.7.4, used only if the installed version's signature cannot be read.
KNOWN_GEMM_BACKENDS = ("cudnn", "cute-dsl", "cute-dsl-native", "blackwell-native", "blackwell-tiled")
#: The instance that also runs fused MoE cases (SGLang's W4A16 path uses CuTe DSL for both).
MOE_GEMM_BACKEND = "cute-dsl"
#: Shape limits the 0.7.4 sources state for a backend (checked at prepare time there): (predicate, reason).
_SHAPE_LIMITS = {
    "blackwell-tiled": (lambda n, k: n % 64 == 0, "blackwell-tiled requires N % 64 == 0 (FlashInfer 0.7.4)"),
}


def offered_gemm_backends(mm_bf16_fp4: Any) -> tuple[str, ...]:
    """The ``backend`` values the installed ``mm_bf16_fp4`` accepts: the ``Literal`` of its signature,
    filtered by FlashInfer's own ``has_backend`` (the 0.7.4 list if the annotation cannot be read)."""
    try:
        names = typing.get_args(inspect.signature(mm_bf16_fp4, eval_str=True).parameters["backend"].annotation)
    except (KeyError, TypeError, ValueError, NameError):
        names = ()
    names = tuple(n for n in names if isinstance(n, str)) or KNOWN_GEMM_BACKENDS
    has = getattr(mm_bf16_fp4, "has_backend", None)
    return tuple(n for n in names if has is None or has(n))


def shape_skip_reason(gemm_backend: str, n: int, k: int) -> str | None:
    """The stated shape limit of ``gemm_backend`` that ``N x K`` breaks, if any."""
    limit = _SHAPE_LIMITS.get(gemm_backend)
    if limit and not limit[0](n, k):
        return f"{limit[1]}; case has N={n}, K={k}"
    return None


@dataclass(frozen=True)
class PreparedDense:
    weight: torch.Tensor
    weight_scale: torch.Tensor
    alpha: torch.Tensor | None
    pre_quant_scale: torch.Tensor | None
    bias: torch.Tensor | None
    out_features: int


class FlashInferBackend(Backend):
    """One FlashInfer ``mm_bf16_fp4`` GEMM backend (``gemm_backend``), or, with ``unavailable`` set, the
    placeholder that skips every case with that reason. ``module`` is the FlashInfer API (the installed
    ``flashinfer``, or the emulator under ``--flashinfer-emulated``); ``platform`` answers the gating questions
    (default: :func:`~conformance.adapters.flashinfer.platform.current_platform`)."""

    tier = "b200"

    def __init__(self, gemm_backend: str | None, module: ModuleType | None = None, unavailable: str | None = None,
                 platform: FlashInferPlatform | None = None):
        self.gemm_backend = gemm_backend
        self.module = module
        self.unavailable = unavailable
        self.platform = platform or current_platform()
        self.name = f"flashinfer-{gemm_backend}" if gemm_backend else "flashinfer"

    def version(self) -> str:
        if self.module is None:
            return "unavailable"
        return f"{self.platform.describe(self.module)}, gemm backend {self.gemm_backend}"

    def skip_reason(self, case: CaseInfo) -> str | None:
        if self.unavailable:
            return self.unavailable
        if case.kind == "moe":
            return self._moe_skip_reason(case)
        gpu = self.platform.gpu(torch.device(case.device))
        if isinstance(gpu, str):
            return gpu
        return (
            capability_skip_reason(self.module.mm_bf16_fp4, self.gemm_backend, gpu.capability, gpu.name)
            or precondition_skip_reason(self.gemm_backend, self.platform)
            or shape_skip_reason(self.gemm_backend, case.shape["n"], case.shape["k"])
            or (self.platform.cute_dsl_gemm_shape_problem(case.shape["m"], case.shape["n"], case.shape["k"],
                                                          gpu.capability) if self.gemm_backend == "cute-dsl" else None)
        )

    def prepare_dense(self, layer: DenseLayer, device: torch.device) -> PreparedDense:
        self._require_available()
        alpha = dense_alpha(layer.weight_scale_2).reshape(1).to(device=device, dtype=torch.float32)
        weight, scales, alpha = self.module.prepare_bf16_fp4_weights(
            layer.weight.to(device).contiguous(),
            swizzle_128x4(layer.weight_scale.to(device)),
            alpha,
            backend=self.gemm_backend,
        )
        pqs = None if layer.pre_quant_scale is None else layer.pre_quant_scale.to(device, torch.bfloat16)
        bias = None if layer.bias is None else layer.bias.to(device, torch.bfloat16)
        return PreparedDense(weight, scales, alpha, pqs, bias, layer.out_features)

    def run_dense(self, prepared: PreparedDense, x: torch.Tensor) -> torch.Tensor:
        self._require_available()
        a = x.reshape(-1, x.shape[-1])
        if prepared.pre_quant_scale is not None:
            a = a * prepared.pre_quant_scale  # bf16 * bf16 -> bf16, as the engine does
        out = self.module.mm_bf16_fp4(
            a.contiguous(),
            prepared.weight,
            prepared.weight_scale,
            prepared.alpha,
            backend=self.gemm_backend,
            out_dtype=torch.bfloat16,
        )
        if prepared.bias is not None:
            out = out + prepared.bias
        return out.reshape(*x.shape[:-1], prepared.out_features)

    # ------------------------------------------------------------------------------------- MoE
    def _moe_skip_reason(self, case: CaseInfo) -> str | None:
        if self.gemm_backend != MOE_GEMM_BACKEND:
            return f"FlashInfer fused MoE is exercised once, under flashinfer-{MOE_GEMM_BACKEND}"
        return _moe_module().flashinfer_moe_skip_reason(case, platform=self.platform)

    def prepare_moe(self, experts: MoEExperts, device: torch.device) -> Any:
        self._require_available()
        return _moe_module().prepare_moe(experts, device, platform=self.platform)

    def run_moe(self, prepared: Any, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        return _moe_module().run_moe(prepared, x, topk_ids, topk_weights)

    def _require_available(self) -> None:
        if self.unavailable:
            raise RuntimeError(self.unavailable)


def _moe_module() -> ModuleType:
    try:
        from conformance.adapters.flashinfer import moe as flashinfer_moe
    except ImportError as exc:
        raise NotImplementedError(
            f"FlashInfer W4A16 MoE adapter (conformance/adapters/flashinfer/moe.py) is not available: {exc}"
        ) from exc
    return flashinfer_moe


def all_backends() -> list[FlashInferBackend]:
    """One backend per GEMM backend FlashInfer offers (on :func:`current_platform`: the installed FlashInfer,
    or the emulator under ``--flashinfer-emulated``); a single skipping placeholder if FlashInfer is missing,
    broken or older than :data:`REQUIRED_VERSION`."""
    platform = current_platform()
    module, reason = platform.load()
    if module is None:
        return [FlashInferBackend(None, unavailable=reason, platform=platform)]
    return [FlashInferBackend(name, module, platform=platform) for name in offered_gemm_backends(module.mm_bf16_fp4)]
