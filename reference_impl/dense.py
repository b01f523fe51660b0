"""W4A16 dense linear: BF16 activations times an NVFP4 weight, SPEC.md section 2.

``y = ((x * pre_quant_scale) @ dequant(W)^T) * alpha + bias`` where ``alpha`` is the weight decode scale
only (``max(weight_scale_2)`` over fused shards, as engines fold one alpha per layer). Under W4A4 alpha
would also hold ``input_scale``: that belongs to the other mode and is never applied here.
"""
from __future__ import annotations

import torch

from .nvfp4 import BLOCK_SIZE, e2m1_decode, e4m3_decode, unpack_nibbles

# Weight elements dequantized at once (64 MiB in fp32): the extra memory is one chunk of W (plus its decode
# temporaries), never a whole dequantized layer, whatever the layer's size.
_CHUNK_ELEMENTS = 1 << 24


def _chunk_rows(k: int) -> int:
    return max(1, _CHUNK_ELEMENTS // k)


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


def _dequant_rows(weight: torch.Tensor, weight_scale: torch.Tensor, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``start:stop`` of ``e2m1 * e4m3`` (without ``weight_scale_2``) in ``dtype``: exact in fp32 and fp64."""
    w = e2m1_decode(unpack_nibbles(weight[start:stop]), dtype)
    return w * e4m3_decode(weight_scale[start:stop]).to(dtype).repeat_interleave(BLOCK_SIZE, dim=-1)


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
    step = _chunk_rows(xa.shape[-1])
    for start in range(0, n, step):  # e2m1 * e4m3 is exact in fp32, so chunking changes nothing
        stop = min(start + step, n)
        w = _dequant_rows(weight, weight_scale, start, stop, accum_dtype)
        out[:, start:stop] = xa @ w.T
        del w
    out.mul_(dense_alpha(weight_scale_2).to(accum_dtype))  # in place: peak extra memory stays one output
    if bias is not None:
        out.add_(bias.to(accum_dtype))
    return out.reshape(*x.shape[:-1], n).to(out_dtype)


def w4a16_linear_exact(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_scale_2: torch.Tensor,
    pre_quant_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact value and its magnitude, both fp64 ``[..., N]``, for error bounds:

    * ``y_exact = ((x * pqs) @ W^T) * alpha + bias`` evaluated in fp64. Every product ``x * pqs`` (two bf16,
      16 significant bits) and ``x' * w`` (with ``w = e2m1 * e4m3``, 6 bits) is exact in fp64; the only fp64
      rounding is in the K-sum, relative error <= K * 2^-53, some 2^29 times below fp32's and negligible here.
    * ``magnitude = (|x * pqs| @ |W|^T) * alpha`` (no bias): the scale of the accumulation error.

    IEEE semantics carry through: a NaN/Inf activation gives a non-finite exact value wherever IEEE fp64
    says so. Dequantizes ``_CHUNK_ELEMENTS`` weights at a time, like :func:`w4a16_linear`."""
    check_dense_inputs(x, weight, weight_scale, pre_quant_scale, bias)
    f64 = torch.float64
    xa = x.to(f64)
    if pre_quant_scale is not None:
        xa = xa * pre_quant_scale.to(f64)
    xa = xa.reshape(-1, xa.shape[-1])
    xabs = xa.abs()
    n = weight.shape[0]
    exact = torch.empty(xa.shape[0], n, dtype=f64, device=x.device)
    magnitude = torch.empty_like(exact)
    step = _chunk_rows(xa.shape[-1])
    for start in range(0, n, step):
        stop = min(start + step, n)
        w = _dequant_rows(weight, weight_scale, start, stop, f64)
        exact[:, start:stop] = xa @ w.T
        magnitude[:, start:stop] = xabs @ w.abs().T
        del w
    alpha = dense_alpha(weight_scale_2).to(f64)
    exact *= alpha
    magnitude *= alpha
    if bias is not None:
        exact += bias.to(f64)
    lead = x.shape[:-1]
    return exact.reshape(*lead, n), magnitude.reshape(*lead, n)
