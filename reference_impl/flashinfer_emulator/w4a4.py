"""The W4A4 path, so an engine's NVFP4 (activation-quantized) path runs on the emulator too:
``fp4_quantize`` / ``nvfp4_quantize`` (FlashInfer's kernel recipe, bit-exact via
:func:`reference_impl.format.nvfp4.quantize_kernel`) and ``mm_fp4`` (both operands NVFP4, fp32 accumulation).

Scope: NVFP4 (``sf_vec_size=16``, E4M3 scales), 128x4 and linear scale layouts, per-tensor global scale.
MXFP4, the 8x4 layout, per-token activation scales and the TRT-LLM shuffled weight layout are not
modelled: they raise ``NotImplementedError`` naming the emulator, never a silently wrong result.
"""
from __future__ import annotations

from enum import IntEnum
from typing import Optional

import torch

from reference_impl.format.nvfp4 import BLOCK_SIZE, e2m1_decode, quantize_kernel, swizzle_128x4, unpack_nibbles
from reference_impl.flashinfer_emulator._device import BackendSupportedError, current_capability
from reference_impl.flashinfer_emulator.layouts import linear_scales_from_swizzled_bytes

_NOT_MODELLED = "flashinfer_emulator does not model {}"


class SfLayout(IntEnum):
    """Same member values as ``flashinfer.SfLayout``."""

    layout_128x4 = 0
    layout_8x4 = 1
    layout_linear = 2


def _quantize(x: torch.Tensor, global_sf: torch.Tensor | float, swizzled: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if x.shape[-1] % BLOCK_SIZE:
        raise AssertionError(f"K={x.shape[-1]} is not a multiple of {BLOCK_SIZE}")  # fp4_quantize asserts this
    rows = x.reshape(-1, x.shape[-1])
    packed, sf = quantize_kernel(rows, global_sf)
    sf = sf.view(torch.uint8)
    if swizzled:
        sf = swizzle_128x4(sf)
    return packed.reshape(*x.shape[:-1], x.shape[-1] // 2), sf


def fp4_quantize(
    input: torch.Tensor,
    global_scale: Optional[torch.Tensor] = None,
    sf_vec_size: int = 16,
    sf_use_ue8m0: bool = False,
    is_sf_swizzled_layout: bool = True,
    is_sf_8x4_layout: bool = False,
    is_global_scale_inversed: bool = False,
    enable_pdl: Optional[bool] = None,
    backend: str = "auto",
    nvfp4_4over6=None,
    *,
    batch_invariant: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Emulates ``flashinfer.fp4_quantize`` (quantization/fp4_quantization.py). ``global_scale`` is the
    *encode* scale (``448 * 6 / amax``); returns (uint8 ``[..., K/2]``, uint8 scales: swizzled
    ``[ceil128(M), ceil4(K/16)]`` or linear ``[M, K/16]``)."""
    del enable_pdl, batch_invariant
    if sf_vec_size != 16 and sf_vec_size != 32:
        raise NotImplementedError("sf_vec_size can only be 16 or 32")
    if backend == "auto":
        backend = "cuda"
    if backend == "cute-dsl" and not ((sf_vec_size == 16 and not sf_use_ue8m0) or (sf_vec_size == 32 and sf_use_ue8m0)):
        raise ValueError(
            f"CuTe-DSL backend does not support sf_vec_size={sf_vec_size} with sf_use_ue8m0={sf_use_ue8m0}. "
            "Supported: (sf_vec_size=16, sf_use_ue8m0=False) for NVFP4, (sf_vec_size=32, sf_use_ue8m0=True) for MXFP4."
        )
    if backend not in ("cuda", "cute-dsl"):
        raise ValueError(f"Unknown backend: {backend}. Must be 'auto', 'cuda' or 'cute-dsl'.")
    if sf_vec_size != 16 or sf_use_ue8m0:
        raise NotImplementedError(_NOT_MODELLED.format("MXFP4 quantization"))
    if is_sf_8x4_layout:
        raise NotImplementedError(_NOT_MODELLED.format("the 8x4 scale layout"))
    if nvfp4_4over6 is not None:
        raise NotImplementedError(_NOT_MODELLED.format("the 4over6 recipe"))
    if input.dtype not in (torch.bfloat16, torch.float16):
        raise NotImplementedError(_NOT_MODELLED.format(f"{input.dtype} input to fp4_quantize"))
    gs = torch.ones((), dtype=torch.float32) if global_scale is None else global_scale.to(torch.float32).reshape(-1)[0]
    if is_global_scale_inversed:
        gs = 1.0 / gs
    column_major = input.dim() >= 2 and input.stride(-2) == 1 and input.shape[-1] > 1
    x = input.transpose(-2, -1) if column_major else input
    x_q, sf = _quantize(x, gs, is_sf_swizzled_layout)
    if column_major:
        return x_q.transpose(-2, -1), sf.transpose(-2, -1)
    return x_q, sf


def nvfp4_quantize(
    a: torch.Tensor,
    a_global_sf,
    sfLayout: SfLayout = SfLayout.layout_128x4,
    do_shuffle: bool = False,
    sf_vec_size: int = 16,
    enable_pdl=None,
    backend: str = "auto",
    per_token_activation: bool = False,
    expanded_idx_to_permuted_idx=None,
    out_scale=None,
    nvfp4_4over6=None,
    *,
    batch_invariant: bool = False,
):
    """Emulates ``flashinfer.nvfp4_quantize`` for the per-tensor recipe."""
    if per_token_activation:
        raise NotImplementedError(_NOT_MODELLED.format("per-token NVFP4 activation scales"))
    if out_scale is not None:
        raise ValueError("out_scale is only supported with per_token_activation=True")
    if do_shuffle:
        raise NotImplementedError(_NOT_MODELLED.format("the TRT-LLM shuffled scale layout"))
    if sfLayout == SfLayout.layout_8x4:
        raise NotImplementedError(_NOT_MODELLED.format("the 8x4 scale layout"))
    gs = a_global_sf if isinstance(a_global_sf, torch.Tensor) else torch.tensor([float(a_global_sf)])
    return fp4_quantize(
        a, gs, sf_vec_size, False, sfLayout == SfLayout.layout_128x4, False, False, enable_pdl,
        backend, nvfp4_4over6,
    )


# ------------------------------------------------------------------------------------------ mm_fp4
# gemm_base.py: @supported_compute_capability on each backend's requirement function.
_MM_FP4_CCS = {
    "cudnn": (100, 103, 107, 110, 120, 121),
    "trtllm": (100, 103, 107),
    "cutlass": (100, 103, 107, 110, 120, 121),
    "cute-dsl": (100, 103, 107, 120, 121),
}


def _check_mm_fp4_problem_size(a, b, a_descale, b_descale, alpha, out_dtype, block_size, backend, use_nvfp4):
    """gemm_base.py:_check_mm_fp4_problem_size."""
    if a.ndim != 2 or b.ndim != 2:
        raise ValueError(f"mm_fp4 accepts 2d tensors, got {a.shape} and {b.shape}")
    if a.shape[1] != b.shape[0]:
        raise ValueError(
            f"K dimension mismatch in mm_fp4. got a.shape[1] = {a.shape[1]}, b.shape[0] = {b.shape[0]}"
        )
    if a.dtype != torch.uint8 or b.dtype != torch.uint8:
        raise ValueError(f"a and b must have float4_e2m1fn_x2 packed into uint8. Got {a.dtype} and {b.dtype}.")
    if a_descale.dtype not in (torch.float8_e4m3fn, torch.uint8) or b_descale.dtype not in (
        torch.float8_e4m3fn,
        torch.uint8,
    ):
        raise ValueError(
            f"a_descale and b_descale must have float8_e4m3fnx2 packed into uint8. "
            f"Got {a_descale.dtype} and {b_descale.dtype}."
        )
    if alpha is not None and alpha.dtype != torch.float:
        raise ValueError(f"alpha must be a float tensor, got {alpha.dtype}")
    if alpha is not None and alpha.numel() != 1:
        raise NotImplementedError(_NOT_MODELLED.format("per-token alpha in mm_fp4"))
    if out_dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(
            f"Unsupported output dtype: {out_dtype}. "
            "Only torch.bfloat16 and torch.float16 are supported for FP4 GEMM operations."
        )
    if use_nvfp4 and block_size != 16:
        raise ValueError("nvfp4 only supports block_size = 16.")
    if not use_nvfp4:
        raise NotImplementedError(_NOT_MODELLED.format("MXFP4 mm_fp4"))


def mm_fp4(
    a: torch.Tensor,
    b: torch.Tensor,
    a_descale: torch.Tensor,
    b_descale: torch.Tensor,
    alpha: Optional[torch.Tensor] = None,
    out_dtype: torch.dtype = torch.bfloat16,
    out: Optional[torch.Tensor] = None,
    block_size: int = 16,
    use_8x4_sf_layout: bool = False,
    backend: str = "auto",
    use_nvfp4: bool = True,
    enable_pdl: bool = True,
    *,
    batch_invariant: bool = False,
    skip_check: bool = False,
) -> torch.Tensor:
    """Emulates ``flashinfer.mm_fp4``: ``a [M, K/2]`` uint8 with 128x4-swizzled ``a_descale``; ``b [K/2, N]``
    (the column-major view ``weight.T`` of an ``[N, K/2]`` weight) with ``b_descale`` the transposed view of
    its 128x4-swizzled scales. ``out = (dequant(a) @ dequant(b)) * alpha``, fp32 accumulation."""
    del enable_pdl, batch_invariant
    if not skip_check:
        cc = current_capability()
        if backend != "auto" and (backend not in _MM_FP4_CCS or cc not in _MM_FP4_CCS[backend]):
            raise BackendSupportedError(f"mm_fp4 does not support backend '{backend}' with capability {cc}")
        _check_mm_fp4_problem_size(a, b, a_descale, b_descale, alpha, out_dtype, block_size, backend, use_nvfp4)
        if backend == "cute-dsl" and use_8x4_sf_layout:
            raise ValueError("cute_dsl FP4 GEMM only supports 128x4 scale factor layout.")
        if backend == "cute-dsl" and b.shape[1] % 8 != 0:
            raise ValueError(f"CuTe-DSL FP4 GEMM requires N % 8 == 0, got n={b.shape[1]}")
    if backend == "trtllm":
        raise NotImplementedError(_NOT_MODELLED.format("the TRT-LLM shuffled weight layout of mm_fp4"))
    if use_8x4_sf_layout:
        raise NotImplementedError(_NOT_MODELLED.format("the 8x4 scale layout"))
    m, k = int(a.shape[0]), int(a.shape[1]) * 2
    n = int(b.shape[1])
    a_vals = _dequant(a, a_descale, m, k)
    b_vals = _dequant(b.t(), b_descale.t(), n, k)
    acc = a_vals @ b_vals.t()
    if alpha is not None:
        acc = acc * alpha.float().reshape(())
    result = acc.to(out_dtype)
    if out is not None:
        out.copy_(result)
        return out
    return result


def _dequant(packed: torch.Tensor, swizzled_sf: torch.Tensor, rows: int, k: int) -> torch.Tensor:
    """Packed codes + 128x4-swizzled scales -> fp32 values (``e2m1 * e4m3`` is exact in fp32)."""
    linear = linear_scales_from_swizzled_bytes(swizzled_sf, rows, k // BLOCK_SIZE).float()
    codes = e2m1_decode(unpack_nibbles(packed.contiguous()))
    return codes * linear.repeat_interleave(BLOCK_SIZE, dim=-1)
