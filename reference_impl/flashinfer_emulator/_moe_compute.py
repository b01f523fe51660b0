"""The arithmetic behind the emulated ``CuteDslMoEWrapper.run`` (W4A16): decode the kernel-layout
operands back to checkpoint form and evaluate :func:`reference_impl.moe.fused_moe_w4a16` on them."""
from __future__ import annotations

import torch

from reference_impl.moe import ExpertWeights, fused_moe_w4a16
from reference_impl.format.nvfp4 import BLOCK_SIZE, from_cutedsl_w13
from reference_impl.flashinfer_emulator.layouts import linear_scales_from_swizzled_bytes, raw_bytes

_SWAP_AB_GROUP_ROWS = 16  # swap_ab=True: up16/gate16 row groups (CuteDslMoEWrapper docstring)
_DEFAULT_GROUP_ROWS = 64  # swap_ab=False: up64/gate64 row groups


def _padded(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def _weights(t: torch.Tensor, e: int, rows: int, half_k: int, what: str) -> torch.Tensor:
    """Packed weights as the kernel reads them: ``e * rows * half_k`` bytes from ``data_ptr()``."""
    if t.dtype != torch.uint8:
        raise TypeError(f"flashinfer_emulator: {what} must be the packed uint8 NVFP4 weight, got {t.dtype}")
    return raw_bytes(t, e * rows * half_k, what).reshape(e, rows, half_k)


def _scales(t: torch.Tensor, e: int, rows: int, k: int, what: str) -> torch.Tensor:
    """Per-expert 128x4-swizzled scales read from ``data_ptr()`` -> linear ``[e, rows, k/16]`` e4m3."""
    per_expert = _padded(rows, 128) * _padded(k // BLOCK_SIZE, 4)
    swizzled = raw_bytes(t, e * per_expert, what)
    return linear_scales_from_swizzled_bytes(swizzled, rows, k // BLOCK_SIZE).reshape(e, rows, k // BLOCK_SIZE)


def _alphas(t: torch.Tensor, e: int, what: str) -> torch.Tensor:
    """``e`` fp32 alphas read from ``data_ptr()`` (the kernel reinterprets the bytes as float32)."""
    if t.dtype != torch.float32:
        raise TypeError(f"flashinfer_emulator: {what} is read as float32 by the kernel, got {t.dtype}")
    return raw_bytes(t, 4 * e, what).view(torch.float32).clone()


def _activation(wrapper) -> tuple[str, dict]:
    name = wrapper.activation_type.name
    if name == "Relu2":
        return "relu2", {}
    if name == "GegluTanh":
        return "geglu", {}
    default = (wrapper.swiglu_alpha, wrapper.swiglu_beta, wrapper.swiglu_limit) == (
        1.0, 0.0, torch.finfo(torch.float32).max
    )
    if default:
        return "swiglu", {}
    return "swiglu_oai", {"alpha": wrapper.swiglu_alpha, "beta": wrapper.swiglu_beta, "limit": wrapper.swiglu_limit}


def run_w4a16_experts(wrapper, x, ids, weights, w1, w1_sf, w1_alpha, w2, w2_sf, w2_alpha) -> torch.Tensor:
    e = wrapper.num_local_experts
    rows1, hidden = int(w1.size(1)), int(w2.size(1))
    inter = int(w2.size(2)) * 2
    w13 = _weights(w1, e, rows1, hidden // 2, "w1_weight")
    w13_scale = _scales(w1_sf, e, rows1, hidden, "w1_weight_sf")
    down = _weights(w2, e, hidden, inter // 2, "w2_weight")
    down_scale = _scales(w2_sf, e, hidden, inter, "w2_weight_sf")
    a1, a2 = _alphas(w1_alpha, e, "w1_alpha"), _alphas(w2_alpha, e, "w2_alpha")
    if wrapper.gated:  # kernel rows [up; gate] in groups -> checkpoint halves [gate; up]
        group = _SWAP_AB_GROUP_ROWS if wrapper.swap_ab else _DEFAULT_GROUP_ROWS
        w13 = from_cutedsl_w13(w13, group)
        w13_scale = from_cutedsl_w13(w13_scale.view(torch.uint8), group).view(torch.float8_e4m3fn)
    activation, params = _activation(wrapper)
    experts = ExpertWeights(
        w13=w13, w13_scale=w13_scale, w13_scale_2=torch.stack((a1, a1), dim=1),  # one alpha for both halves
        w2=down, w2_scale=down_scale, w2_scale_2=a2, activation=activation, activation_params=params,
    )
    local_ids = ids.long() - wrapper.local_expert_offset  # ids outside [0, e) contribute nothing
    return fused_moe_w4a16(x, local_ids, weights, experts, out_dtype=wrapper.output_dtype)
