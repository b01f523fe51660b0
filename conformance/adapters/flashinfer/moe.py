"""FlashInfer's W4A16 fused MoE (``CuteDslMoEWrapper(quant_mode="w4a16")``) behind the adapter.

``conformance/adapters/flashinfer/kernel.py`` (the dense backend) delegates its ``prepare_moe``/``run_moe``/MoE
skip reasons here. The layout half is pure PyTorch (runs and is tested on CPU); only :func:`run_moe`
needs FlashInfer's CuTe DSL kernels (SM100/103/107), or the emulator's under ``--flashinfer-emulated``.

The contract, read from FlashInfer 0.7.4 (``fused_moe/cute_dsl/fused_moe.py``, ``blackwell/moe_w4a16*.py``)
and SGLang 0.5.23 (``modelopt_quant.py`` ``ModelOptNvFp4FusedMoEMethod``, ``moe_runner/
flashinfer_cutedsl.py``):

* ``w1_weight [E, 2I, H/2]`` uint8: the halves ``[up; gate]`` interleaved in 64-row chunks
  (up[0:64], gate[0:64], up[64:128], ...) -- ``reference_impl.format.nvfp4.to_cutedsl_w13``; non-gated (relu2)
  weights are used as they are. Block scales follow the same row order.
* scales: 128x4-swizzled per expert, then viewed in the MMA layout: ``convert_sf_to_mma_layout(flat,
  m=rows, k=cols, num_groups=E)`` is a 6-D strided *view* ``(32, 4, m_tiles, 4, k_tiles, E)`` of the
  swizzled bytes (physical order ``(E, m_tiles, k_tiles, 32, 4, 4)``); :func:`mma_layout_view` builds
  the same view without importing CUTLASS.
* ``w1_alpha [E]`` fp32: ONE GEMM1 alpha per expert, applied to both halves (the epilogue multiplies
  up and gate by ``alpha[group]``); ``w2_alpha [E]`` = ``w2_weight_scale_2``. Under W4A16 the input
  scales are neutral: ``x_sf=None``, ``fc2_input_scale=None``, alphas hold weight decode scales only.
* Different gate/up decode scales: the kernel cannot take two. SGLang 0.5.23's CuTe DSL path takes
  column 0 (the gate scale) for both halves (``resolve_cutedsl_standard_scales._align_scale_to_alpha``),
  which mis-scales ``up`` when they differ (its "must match" warning is on the Marlin path only); its
  TRT-LLM path rescales the smaller half's E4M3 block scales onto ``max(gate, up)``. This adapter
  folds exactly: alpha = the larger scale, the other half's block scales times the ratio, *only if*
  every rescaled E4M3 value is exact (e.g. a power-of-two ratio without underflow); otherwise it
  declines the case (:func:`fold_gate_up_scales` says why) instead of computing a different model.
* ``use_fused_finalize=False``: the deterministic two-stage finalize (fused finalize combines with
  bf16 atomics in arbitrary order and is not bitwise reproducible; the error bound covers both).
"""
from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from reference_impl.format.nvfp4 import W13_CHUNK_ROWS, swizzle_128x4, swizzled_shape, to_cutedsl_w13, unswizzle_128x4

from conformance.interfaces.kernel import CaseInfo, MoEExperts
from conformance.adapters.flashinfer.platform import (  # noqa: F401 - the MoE gate lives with the platform's
    SUPPORTED_CAPABILITIES,
    FlashInferPlatform,
    current_platform,
    flashinfer_moe_skip_reason,
)

_ACTIVATION_TYPE_NAMES = {"swiglu": "Swiglu", "swiglu_oai": "Swiglu", "geglu": "GegluTanh", "relu2": "Relu2"}


class GateUpFoldError(ValueError):
    """Gate and up decode scales differ and cannot be folded into one alpha exactly."""


# ----------------------------------------------------------------------------------------- layout (CPU)
def mma_layout_view(swizzled: torch.Tensor, rows: int, cols: int, num_groups: int) -> torch.Tensor:
    """The MMA-layout view of per-expert 128x4-swizzled scales (what ``convert_sf_to_mma_layout`` returns):
    ``(32, 4, m_tiles, 4, k_tiles, E)`` over physical ``(E, m_tiles, k_tiles, 32, 4, 4)`` bytes."""
    pr, pc = swizzled_shape(rows, cols // 16)
    m_tiles, k_tiles = pr // 128, pc // 4
    flat = swizzled.contiguous().view(torch.uint8).reshape(-1)
    if flat.numel() != num_groups * pr * pc:
        raise ValueError(f"{flat.numel()} scale bytes, expected {num_groups} x {pr} x {pc}")
    return flat.view(num_groups, m_tiles, k_tiles, 32, 4, 4).permute(3, 4, 1, 5, 2, 0)


def mma_layout_to_swizzled(view: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`mma_layout_view`: ``[E, m_tiles*128, k_tiles*4]`` swizzled bytes."""
    phys = view.permute(5, 2, 4, 0, 1, 3)
    e, mt, kt = phys.shape[0], phys.shape[1], phys.shape[2]
    return phys.contiguous().reshape(e, mt * 128, kt * 4)


def fold_gate_up_scales(
    w13_scale: torch.Tensor, w13_scale_2: torch.Tensor, gated: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(block scales with the gate/up decode-scale ratio folded in, alpha ``[E]``); raises
    :class:`GateUpFoldError` naming the expert when an exact fold is impossible."""
    s = w13_scale_2.float().reshape(w13_scale_2.shape[0], -1)
    if not gated or s.shape[1] == 1:
        return w13_scale, s[:, 0].contiguous()
    gate_s, up_s = s[:, 0], s[:, 1]
    alpha = torch.maximum(gate_s, up_s)
    if torch.equal(gate_s, up_s):
        return w13_scale, alpha.contiguous()
    half = w13_scale.shape[1] // 2
    ratios = torch.stack([gate_s / alpha, up_s / alpha], dim=1).double()  # <= 1, per half
    bs = w13_scale.float().double().unflatten(1, (2, half))
    target = bs * ratios[:, :, None, None]
    folded = target.float().to(torch.float8_e4m3fn)
    bad = folded.double() != target
    if bool(bad.any()):
        e = int(bad.flatten(1).any(1).nonzero()[0])
        raise GateUpFoldError(
            f"expert {e}: gate/up decode scales {gate_s[e].item():.6g}/{up_s[e].item():.6g} (ratio "
            f"{(gate_s[e] / up_s[e]).item():.6g}) cannot be folded into one GEMM1 alpha exactly: rescaled E4M3 "
            f"block scales would round ({int(bad[e].sum())} of them). CuteDslMoEWrapper takes one alpha per "
            f"expert; SGLang 0.5.23 uses the gate scale for both halves here."
        )
    return folded.flatten(1, 2).contiguous(), alpha.contiguous()


@dataclass(frozen=True)
class KernelMoEWeights:
    """Everything ``CuteDslMoEWrapper.run`` takes for the weights, on one device."""

    w1: torch.Tensor  # [E, 2I, H/2] uint8, [up; gate] 64-row interleave (relu2: [E, I, H/2])
    w1_sf: torch.Tensor  # MMA-layout view
    w1_alpha: torch.Tensor  # [E] fp32
    w2: torch.Tensor  # [E, H, I/2] uint8
    w2_sf: torch.Tensor  # MMA-layout view
    w2_alpha: torch.Tensor  # [E] fp32
    gated: bool
    chunk_rows: int = W13_CHUNK_ROWS


def build_kernel_layout(experts: MoEExperts, device: torch.device | str = "cpu", chunk_rows: int = W13_CHUNK_ROWS) -> KernelMoEWeights:
    """Checkpoint tensors -> the CuTe DSL W4A16 MoE layout (module docstring). Input scales are ignored."""
    from reference_impl.moe import is_gated

    gated = is_gated(experts.activation)
    scale13, alpha1 = fold_gate_up_scales(experts.w13_scale, experts.w13_scale_2, gated)
    w1, sf1 = experts.w13, scale13
    if gated:
        w1, sf1 = to_cutedsl_w13(w1, chunk_rows), to_cutedsl_w13(sf1, chunk_rows)
    e, rows1, hidden = w1.shape[0], w1.shape[1], w1.shape[2] * 2
    rows2, inter = experts.w2.shape[1], experts.w2.shape[2] * 2
    return KernelMoEWeights(
        w1=w1.contiguous().to(device),
        w1_sf=mma_layout_view(swizzle_128x4(sf1.view(torch.uint8)).to(device), rows1, hidden, e),
        w1_alpha=alpha1.float().contiguous().to(device),
        w2=experts.w2.contiguous().to(device),
        w2_sf=mma_layout_view(swizzle_128x4(experts.w2_scale.view(torch.uint8)).to(device), rows2, inter, e),
        w2_alpha=experts.w2_scale_2.float().reshape(-1).contiguous().to(device),
        gated=gated,
        chunk_rows=chunk_rows,
    )


# ----------------------------------------------------------------------------------------- FlashInfer
@dataclass
class PreparedFlashInferMoE:
    weights: KernelMoEWeights
    experts_meta: dict
    wrappers: dict = field(default_factory=dict)  # top_k -> CuteDslMoEWrapper
    #: returns (CuteDslMoEWrapper class, ActivationType): the platform's (FlashInfer's, or the emulator's)
    wrapper_source: Callable[[], tuple[Any, Any]] | None = None


def prepare_moe(
    experts: MoEExperts, device: torch.device, *, wrapper_source: Callable[[], tuple[Any, Any]] | None = None,
    platform: FlashInferPlatform | None = None,
) -> PreparedFlashInferMoE:
    """Build the kernel layout on ``device`` once. Raises :class:`GateUpFoldError` for untied scales
    that cannot be folded exactly, ``RuntimeError`` with the skip reason when the kernel cannot run.
    ``wrapper_source`` substitutes another ``CuteDslMoEWrapper`` without any gating (self-tests);
    otherwise ``platform`` (default: the current one) gates and supplies it."""
    if wrapper_source is None:
        platform = platform or current_platform()
        reason = flashinfer_moe_skip_reason(None, device, platform)
        if reason:
            raise RuntimeError(reason)
        wrapper_source = platform.moe_wrapper
    weights = build_kernel_layout(experts, device)
    num_global = experts.num_global_experts or experts.num_local_experts * experts.ep_size
    meta = dict(
        num_experts=num_global,
        num_local_experts=experts.num_local_experts,
        local_expert_offset=experts.ep_rank * experts.num_local_experts,
        hidden_size=experts.hidden_size,
        intermediate_size=experts.intermediate_size,
        activation=experts.activation,
        activation_params=dict(experts.activation_params),
        device=str(device),
    )
    return PreparedFlashInferMoE(weights, meta, wrapper_source=wrapper_source)


def _wrapper_for(prepared: PreparedFlashInferMoE, top_k: int) -> Any:
    if top_k not in prepared.wrappers:
        from reference_impl.moe import oai_params

        wrapper_cls, activation_type = (prepared.wrapper_source or current_platform().moe_wrapper)()
        m = prepared.experts_meta
        kwargs = dict(
            num_experts=m["num_experts"],
            top_k=top_k,
            hidden_size=m["hidden_size"],
            intermediate_size=m["intermediate_size"],
            num_local_experts=m["num_local_experts"],
            local_expert_offset=m["local_expert_offset"],
            output_dtype=torch.bfloat16,
            device=m["device"],
            activation_type=getattr(activation_type, _ACTIVATION_TYPE_NAMES[m["activation"]]),
            use_fused_finalize=False,
            quant_mode="w4a16",
        )
        if m["activation"] == "swiglu_oai":
            alpha, beta, limit = oai_params(m["activation_params"])
            kwargs.update(swiglu_alpha=alpha, swiglu_beta=beta, swiglu_limit=limit)
        prepared.wrappers[top_k] = wrapper_cls(**kwargs)
    return prepared.wrappers[top_k]


def run_moe(prepared: PreparedFlashInferMoE, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """One ``CuteDslMoEWrapper.run`` in W4A16 mode: BF16 ``x``, ``x_sf=None``, ``fc2_input_scale=None``."""
    w = prepared.weights
    wrapper = _wrapper_for(prepared, topk_ids.shape[1])
    return wrapper.run(
        x.contiguous(),
        None,
        topk_ids.to(torch.int32).contiguous(),
        topk_weights.to(torch.float32).contiguous(),
        w.w1,
        w.w1_sf,
        w.w1_alpha,
        None,
        w.w2,
        w.w2_sf,
        w.w2_alpha,
    )


def read_back_kernel_layout(layout: KernelMoEWeights, like: MoEExperts, chunk_rows: int | None = None) -> MoEExperts:
    """Invert :func:`build_kernel_layout` into checkpoint form (halves ``[gate; up]``, linear scales,
    one shared decode scale per expert). Used on CPU to test the layout, and by the mutants."""
    from dataclasses import replace

    from reference_impl.format.nvfp4 import from_cutedsl_w13

    chunk = chunk_rows or layout.chunk_rows
    e, rows1, hidden = layout.w1.shape[0], layout.w1.shape[1], layout.w1.shape[2] * 2
    rows2, inter = layout.w2.shape[1], layout.w2.shape[2] * 2
    sf1 = unswizzle_128x4(mma_layout_to_swizzled(layout.w1_sf), rows1, hidden // 16).view(torch.float8_e4m3fn)
    sf2 = unswizzle_128x4(mma_layout_to_swizzled(layout.w2_sf), rows2, inter // 16).view(torch.float8_e4m3fn)
    w1 = layout.w1.cpu()
    sf1 = sf1.cpu()
    if layout.gated:
        w1, sf1 = from_cutedsl_w13(w1, chunk), from_cutedsl_w13(sf1, chunk)
    alpha = layout.w1_alpha.cpu()
    return replace(
        like,
        w13=w1,
        w13_scale=sf1,
        w13_scale_2=torch.stack([alpha, alpha], dim=1),
        w2=layout.w2.cpu(),
        w2_scale=sf2.cpu(),
        w2_scale_2=layout.w2_alpha.cpu(),
    )
