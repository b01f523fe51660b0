"""W4A16 dense linear: BF16 activations times an NVFP4 weight, SPEC.md section 2.

``y = ((x * pre_quant_scale) @ dequant(W)^T) * alpha + bias`` where ``alpha`` is the weight decode scale
only (``max(weight_scale_2)`` over fused shards, as engines fold one alpha per layer). Under W4A4 alpha
would also hold ``input_scale``: that belongs to the other mode and is never applied here.
"""
from __future__ import annotations

import torch

from .nvfp4 import BLOCK_SIZE, e2m1_decode, e4m3_decode, unpack_nibbles

_N_CHUNK = 4096  # rows of W dequantized at once: bounds the extra memory to one chunk, not one layer


def dense_alpha(weight_scale_2: torch.Tensor) -> torch.Tensor:
    """The W4A16 GEMM alpha: the largest per-shard decode scale, fp32 0-d."""
    return weight_scale_2.detach().float().reshape(-1).max()


def check_dense_inputs(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    pre_quant_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> None:
    """Raise ``TypeError``/``ValueError`` with a readable message for inputs that do not fit."""
    if x.dtype != torch.bfloat16:
        raise TypeError(f"W4A16 activations must be bfloat16, got {x.dtype}")
    if weight.dtype != torch.uint8 or weight.dim() != 2:
        raise TypeError(f"packed weight must be a 2-D uint8 tensor, got {weight.dtype} {tuple(weight.shape)}")
    n, k = weight.shape[0], weight.shape[1] * 2
    if x.shape[-1] != k:
        raise ValueError(f"activation K = {x.shape[-1]} does not match weight K = {k}")
    if weight_scale.shape != (n, k // BLOCK_SIZE):
        raise ValueError(f"block scale shape {tuple(weight_scale.shape)} != ({n}, {k // BLOCK_SIZE}) (linear layout)")
    if pre_quant_scale is not None and pre_quant_scale.shape != (k,):
        raise ValueError(f"pre_quant_scale shape {tuple(pre_quant_scale.shape)} != ({k},)")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias shape {tuple(bias.shape)} != ({n},)")


def w4a16_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_scale_2: torch.Tensor,
    pre_quant_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    accum_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The reference W4A16 linear layer. ``x [..., K]`` bf16, ``weight [N, K/2]`` uint8, ``weight_scale
    [N, K/16]`` e4m3 (linear), ``weight_scale_2`` fp32 (one per fused shard). Accumulates in
    ``accum_dtype`` (fp32 by default; fp64 gives the exact value the error bounds are measured from)."""
    check_dense_inputs(x, weight, weight_scale, pre_quant_scale, bias)
    xa = x.to(accum_dtype)
    if pre_quant_scale is not None:
        xa = xa * pre_quant_scale.to(accum_dtype)
    xa = xa.reshape(-1, xa.shape[-1])
    n = weight.shape[0]
    out = torch.empty(xa.shape[0], n, dtype=accum_dtype, device=x.device)
    for start in range(0, n, _N_CHUNK):  # e2m1 * e4m3 is exact in fp32, so chunking changes nothing
        stop = min(start + _N_CHUNK, n)
        w = e2m1_decode(unpack_nibbles(weight[start:stop]), accum_dtype)
        w = w * e4m3_decode(weight_scale[start:stop]).to(accum_dtype).repeat_interleave(BLOCK_SIZE, dim=-1)
        out[:, start:stop] = xa @ w.T
        del w
    out = out * dense_alpha(weight_scale_2).to(accum_dtype)
    if bias is not None:
        out = out + bias.to(accum_dtype)
    return out.reshape(*x.shape[:-1], n).to(out_dtype)
