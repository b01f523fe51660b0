"""Dense GEMM entry points: ``prepare_bf16_fp4_weights`` / ``mm_bf16_fp4`` (W4A16) and ``mm_fp4`` (W4A4),
with FlashInfer 0.7.4's signatures, argument checks (same exception types, same order) and the reference
result (:func:`reference_impl.dense.w4a16_linear`: fp32 accumulation, alpha applied once, one cast).

Each check names the FlashInfer function it mirrors. Prepared tensors follow the real layouts where an
engine can observe them (``cute-dsl`` on SM100: canonical uint8 weight + the 6-D MMA scale view;
``cudnn`` / ``blackwell-native``: linear e4m3 scales); ``blackwell-tiled`` keeps the real dtypes and shapes
(int32 ``[K/16, 2N]`` weight, uint8 ``[K/16, N]`` scales) but with the emulator's own byte order, so
never mix real and emulated prepared tensors.
"""
from __future__ import annotations

from typing import Literal, Optional

import torch

from reference_impl.dense import w4a16_linear
from reference_impl.flashinfer_emulator._device import BackendSupportedError, current_capability, current_major_minor, uses_sm100_layout
from reference_impl.flashinfer_emulator.layouts import convert_sf_from_mma_layout, convert_sf_to_mma_layout, linear_scales_from_swizzled_bytes

BF16_FP4_BACKENDS = ("cudnn", "cute-dsl", "cute-dsl-native", "blackwell-native", "blackwell-tiled")
#: The ``backend`` annotation of ``mm_bf16_fp4`` (FlashInfer's ``_Bf16Fp4Backend``): callers read the offered
#: backends from it, as from the real signature.
Bf16Fp4Backend = Literal["cudnn", "cute-dsl", "cute-dsl-native", "blackwell-native", "blackwell-tiled"]
# Compute capabilities per backend checker (gemm_bf16_fp4.py, @supported_compute_capability).
_BF16_FP4_CCS = {
    "cudnn": (100, 103, 107, 110, 120, 121),
    "cute-dsl": (100, 103, 107, 110, 120, 121),
    "cute-dsl-native": (120, 121),
    "blackwell-native": (100, 103),
    "blackwell-tiled": (100, 103),
}
_UNKNOWN_BACKEND = (
    "Unknown backend {!r}.  Supported: 'cudnn', 'cute-dsl', 'cute-dsl-native', 'blackwell-native', 'blackwell-tiled'."
)


def _swizzled_sf_bytes(n: int, k_sf: int) -> int:
    return ((n + 127) // 128) * ((k_sf + 3) // 4) * 512


# ------------------------------------------------------------------------------------------ prepare
def prepare_bf16_fp4_weights(
    b: torch.Tensor,
    b_descale: torch.Tensor,
    alpha: Optional[torch.Tensor] = None,
    *,
    backend: str,
    block_size: int = 16,
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Emulates ``flashinfer.prepare_bf16_fp4_weights`` (gemm/gemm_bf16_fp4.py)."""
    if b.dim() != 2:
        raise ValueError(f"b must be 2-D (N, K/2); got shape {tuple(b.shape)}")
    if b.dtype != torch.uint8:
        raise TypeError(f"b must be uint8; got {b.dtype}")
    k = int(b.shape[1]) * 2
    if k % block_size != 0:
        raise ValueError(f"K={k} must be a multiple of block_size={block_size}")
    n = int(b.shape[0])
    k_sf = k // block_size
    expected = _swizzled_sf_bytes(n, k_sf)
    sf_bytes = b_descale.numel() * b_descale.element_size()
    if sf_bytes < expected:
        raise ValueError(
            f"b_descale has {sf_bytes} bytes but the 128x4-swizzled layout for "
            f"N={n}, K_sf={k_sf} requires at least {expected}"
        )
    if alpha is not None:
        if alpha.dim() != 1 or alpha.shape[0] != 1:
            raise ValueError(f"alpha must be shape (1,); got {tuple(alpha.shape)}")
        if alpha.dtype != torch.float32:
            raise TypeError(f"alpha must be float32; got {alpha.dtype}")
    if backend == "cute-dsl-native":
        _check_native_weights(b, b_descale, alpha, block_size)
        return b, b_descale, alpha
    if backend == "cudnn":  # gemm_bf16_fp4_cudnn._prepare_cudnn: linear scales, weight unchanged
        return b, _linear_from_canonical(b_descale, n, k_sf), alpha
    if backend == "cute-dsl":  # gemm_bf16_fp4_cute_dsl._prepare_cute_dsl
        major, minor = current_major_minor()
        if uses_sm100_layout():
            sf = convert_sf_to_mma_layout(b_descale.contiguous(), m=n, k=k, num_groups=1, sf_vec_size=block_size)
            return b.contiguous(), sf, alpha
        if major == 12:
            raise NotImplementedError(
                "flashinfer_emulator models the SM100-family cute-dsl layout only (SM12x prepares int32 weights)"
            )
        raise NotImplementedError(f"cute-dsl w4a16 GEMM only supports SM100/103/107 and SM12x; got {major}.{minor}")
    if backend in ("blackwell-native", "blackwell-tiled"):  # gemm_bf16_fp4_blackwell._prepare_blackwell_bf16_fp4
        if block_size != 16:
            raise ValueError(f"source-built BF16 x FP4 preparation requires block_size=16; got {block_size}")
        _require_sm100_or_sm103()
        if b.device != b_descale.device:
            raise ValueError(f"b and b_descale must be on the same device; got {b.device} and {b_descale.device}")
        if alpha is not None and alpha.device != b.device:
            raise ValueError(f"alpha must be on the same device as b ({b.device}); got {alpha.device}")
        linear = _linear_from_canonical(b_descale, n, k_sf)
        if backend == "blackwell-native":
            return b.contiguous(), linear, alpha
        if n % 64 != 0:
            raise ValueError(f"blackwell-tiled requires N to be a multiple of 64; got N={n}")
        return _pack_tiled(b), linear.view(torch.uint8).t().contiguous(), alpha
    raise ValueError(_UNKNOWN_BACKEND.format(backend))


def _linear_from_canonical(b_descale: torch.Tensor, n: int, k_sf: int) -> torch.Tensor:
    """The first swizzled-size bytes of the canonical buffer, unswizzled (``_unswizzle_sf_128x4``)."""
    flat = b_descale.contiguous().view(torch.uint8).reshape(-1)[: _swizzled_sf_bytes(n, k_sf)]
    return linear_scales_from_swizzled_bytes(flat, n, k_sf).contiguous()


def _pack_tiled(b: torch.Tensor) -> torch.Tensor:
    """Emulator byte order for blackwell-tiled: per 16-element K block and column, its 8 bytes as 2 int32."""
    n, half_k = b.shape
    b_kn = b.t().contiguous().reshape(half_k // 8, 8, n).permute(0, 2, 1).contiguous()
    return b_kn.view(torch.int32).reshape(half_k // 8, 2 * n)


def _unpack_tiled(b: torch.Tensor) -> torch.Tensor:
    k_tiles, two_n = b.shape
    n = two_n // 2
    raw = b.contiguous().reshape(k_tiles, n, 2).view(torch.uint8).reshape(k_tiles, n, 8)
    return raw.permute(0, 2, 1).reshape(k_tiles * 8, n).t().contiguous()


def _require_sm100_or_sm103() -> None:
    major, minor = current_major_minor()
    if (major, minor) not in ((10, 0), (10, 3)):
        raise NotImplementedError(f"the source-built BF16 x FP4 backends require SM100 or SM103; got SM{major}{minor}")


def _check_native_weights(b, b_descale, alpha, block_size) -> tuple[int, int]:
    """kernels/native_bf16_fp4/support.py:check_weights (any device counts as the emulated CUDA device)."""
    if block_size != 16:
        raise ValueError("cute-dsl-native requires block_size=16")
    if b.ndim != 2 or b.dtype != torch.uint8 or not b.is_contiguous():
        raise ValueError("cute-dsl-native requires contiguous uint8 weights (N,K/2)")
    n, k = b.shape[0], b.shape[1] * 2
    if min(n, k) <= 0 or k % 16:
        raise ValueError("cute-dsl-native requires positive N/K and K divisible by 16")
    if (
        b_descale.dtype not in (torch.uint8, torch.float8_e4m3fn)
        or not b_descale.is_contiguous()
        or b_descale.numel() != _swizzled_sf_bytes(n, k // 16)
    ):
        raise ValueError("cute-dsl-native requires the compact 128x4 E4M3 scale buffer")
    tensors = [b, b_descale]
    if alpha is not None:
        if alpha.dtype != torch.float32 or alpha.shape != (1,):
            raise ValueError("cute-dsl-native alpha must be float32 with shape (1,)")
        tensors.append(alpha)
    if any(t.device != b.device for t in tensors):
        raise ValueError("cute-dsl-native requires operands on one CUDA device")
    return n, k


# ------------------------------------------------------------------------------------------ mm_bf16_fp4
def _check_mm_bf16_fp4_problem_size(a, b, b_descale, alpha, out_dtype, block_size) -> None:
    """gemm_bf16_fp4.py:_check_mm_bf16_fp4_problem_size (the decorator's common check)."""
    if a.dim() != 2:
        raise ValueError(f"a must be 2-D (M, K); got shape {tuple(a.shape)}")
    if a.dtype != torch.bfloat16:
        raise TypeError(f"a must be bfloat16; got {a.dtype}.  fp16 support is not implemented yet.")
    if out_dtype is not None and out_dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"out_dtype must be bfloat16 or float16; got {out_dtype}")
    if block_size != 16:
        raise ValueError(f"block_size must be 16 for FP4; got {block_size}")
    if alpha is not None and alpha.device != a.device:
        raise ValueError(f"alpha must be on the same device as a ({a.device}); got {alpha.device}")


def mm_bf16_fp4(
    a: torch.Tensor,
    b: torch.Tensor,
    b_descale: torch.Tensor,
    alpha: Optional[torch.Tensor] = None,
    *,
    backend: Bf16Fp4Backend,
    out_dtype: Optional[torch.dtype] = None,
    out: Optional[torch.Tensor] = None,
    block_size: int = 16,
    enable_pdl: bool = True,
    skip_check: bool = False,
) -> torch.Tensor:
    """Emulates ``flashinfer.mm_bf16_fp4``: ``out = (a @ dequant(b).T) * alpha`` for prepared ``b``."""
    del enable_pdl
    if not skip_check:  # utils.backend_requirement: backend + capability, common check, backend check
        cc = current_capability()
        if backend == "auto":
            _check_mm_bf16_fp4_problem_size(a, b, b_descale, alpha, out_dtype, block_size)
            raise AssertionError("Heuristic function must be provided")  # mm_bf16_fp4 registers none
        if backend not in _BF16_FP4_CCS or cc not in _BF16_FP4_CCS[backend]:
            raise BackendSupportedError(f"mm_bf16_fp4 does not support backend '{backend}' with capability {cc}")
        _check_mm_bf16_fp4_problem_size(a, b, b_descale, alpha, out_dtype, block_size)
        if backend == "cudnn" and b.dtype != torch.uint8:  # _cudnn_bf16_fp4_requirement
            raise ValueError(
                "cudnn bf16 x fp4 expects the uint8 prepared weight from "
                f"prepare_bf16_fp4_weights(..., backend='cudnn'); got {b.dtype}."
            )
        if backend == "cute-dsl":  # _cute_dsl_bf16_fp4_requirement
            expected = torch.uint8 if uses_sm100_layout() else torch.int32
            if b.dtype != expected:
                raise ValueError(
                    f"cute-dsl bf16 x fp4 on SM{cc} expects the {expected} weight returned by "
                    f"prepare_bf16_fp4_weights(..., backend='cute-dsl'); got {b.dtype}."
                )
        elif backend in ("blackwell-native", "blackwell-tiled"):
            _validate_blackwell(a, b, b_descale, alpha, out_dtype or a.dtype, out, block_size, backend)
    out_dtype = out_dtype or a.dtype
    if backend == "cute-dsl":
        return _compute_cute_dsl(a, b, b_descale, alpha, out_dtype, out, block_size)
    if backend == "cudnn":
        n, k = int(b.shape[0]), int(b.shape[1]) * 2
        if a.shape[1] != k:
            raise ValueError(f"a.shape[1]={a.shape[1]} but k inferred from b.shape={tuple(b.shape)} is {k}")
        return _finish(a, b, b_descale.reshape(n, k // block_size), alpha, out_dtype, out)
    if backend == "blackwell-native":
        return _finish(a, b, b_descale, alpha, out_dtype, out)
    if backend == "blackwell-tiled":
        return _finish(a, _unpack_tiled(b), b_descale.t().contiguous().view(torch.float8_e4m3fn), alpha, out_dtype, out)
    if backend == "cute-dsl-native":
        raise BackendSupportedError(f"mm_bf16_fp4 does not support backend '{backend}' with capability {current_capability()}")
    raise ValueError(_UNKNOWN_BACKEND.format(backend))


def _validate_blackwell(a, b, b_descale, alpha, out_dtype, out, block_size, backend) -> None:
    """gemm_bf16_fp4_blackwell.py:_validate_blackwell_bf16_fp4."""
    if a.dim() != 2 or a.dtype != torch.bfloat16:
        raise ValueError(
            f"source-built BF16 x FP4 GEMM expects a as bfloat16 [M, K]; got dtype={a.dtype}, shape={tuple(a.shape)}"
        )
    k = int(a.shape[1])
    if k % block_size != 0:
        raise ValueError(f"K={k} must be a multiple of block_size={block_size}")
    if backend == "blackwell-native":
        if b.dim() != 2 or b.dtype != torch.uint8:
            raise ValueError(
                "blackwell-native expects the uint8 [N, K/2] weight returned by "
                "prepare_bf16_fp4_weights(..., backend='blackwell-native')"
            )
        n = int(b.shape[0])
        if k != int(b.shape[1]) * 2:
            raise ValueError(f"a.shape[1]={k} but prepared b encodes K={int(b.shape[1]) * 2}")
        if b_descale.dtype != torch.float8_e4m3fn or tuple(b_descale.shape) != (n, k // block_size):
            raise ValueError(
                f"blackwell-native expects linear float8_e4m3fn scales with shape {(n, k // block_size)}; "
                f"got dtype={b_descale.dtype}, shape={tuple(b_descale.shape)}"
            )
    else:
        if b.dim() != 2 or b.dtype != torch.int32 or int(b.shape[1]) % 2 != 0:
            raise ValueError(
                "blackwell-tiled expects the int32 [K/16, N*2] weight returned by "
                "prepare_bf16_fp4_weights(..., backend='blackwell-tiled')"
            )
        k_tiles, n = int(b.shape[0]), int(b.shape[1]) // 2
        if k != k_tiles * block_size:
            raise ValueError(f"a.shape[1]={k} but prepared b encodes K={k_tiles * block_size}")
        if n % 64 != 0:
            raise ValueError(f"blackwell-tiled requires N to be a multiple of 64; got N={n}")
        if b_descale.dtype != torch.uint8 or tuple(b_descale.shape) != (k_tiles, n):
            raise ValueError(
                f"blackwell-tiled expects S0E5M3 uint8 scales with shape {(k_tiles, n)}; "
                f"got dtype={b_descale.dtype}, shape={tuple(b_descale.shape)}"
            )
        if out_dtype != torch.bfloat16:
            raise ValueError(f"blackwell-tiled requires bfloat16 output; got {out_dtype}")
    if b.device != a.device or b_descale.device != a.device:
        raise ValueError("a, b, and b_descale must be on the same device")
    if alpha is not None and (alpha.dtype != torch.float32 or tuple(alpha.shape) != (1,)):
        raise ValueError(
            f"alpha must be a contiguous float32 tensor with shape (1,); got dtype={alpha.dtype}, "
            f"shape={tuple(alpha.shape)}, contiguous={alpha.is_contiguous()}"
        )


def _compute_cute_dsl(a, b, b_descale, alpha, out_dtype, out, block_size) -> torch.Tensor:
    """gemm_bf16_fp4_cute_dsl.py:_compute_cute_dsl_sm100 checks, then the reference product."""
    if a.device != b.device or a.device != b_descale.device:
        raise ValueError(
            f"a, b, and b_descale must be on the same CUDA device; got {a.device}, {b.device}, and {b_descale.device}."
        )
    if not a.is_contiguous() or not b.is_contiguous():
        raise ValueError("SM100 cute-dsl requires contiguous a and b tensors.")
    if a.dtype != torch.bfloat16:
        raise TypeError(f"SM100 cute-dsl currently requires a bfloat16 activation; got {a.dtype}.")
    if b.dtype != torch.uint8:
        raise TypeError(
            "SM100 cute-dsl expects the uint8 NVFP4 weight returned by "
            f"prepare_bf16_fp4_weights(..., backend='cute-dsl'); got {b.dtype}."
        )
    if out_dtype != torch.bfloat16:
        raise NotImplementedError(f"SM100 cute-dsl currently requires a bfloat16 output; got {out_dtype}.")
    k, n = int(a.shape[1]), int(b.shape[0])
    if int(b.shape[1]) * 2 != k:
        raise ValueError(f"a.shape[1]={k} but b.shape={tuple(b.shape)} encodes K={int(b.shape[1]) * 2}")
    if b_descale.dim() != 6 or tuple(b_descale.shape) != tuple(
        [32, 4, (n + 127) // 128, 4, (k // block_size + 3) // 4, 1]
    ):
        # The real kernel builds a TMA descriptor from this view; anything else is undefined there.
        raise ValueError(
            "flashinfer_emulator: cute-dsl expects the 6-D MMA scale view returned by "
            f"prepare_bf16_fp4_weights(..., backend='cute-dsl'); got shape {tuple(b_descale.shape)}"
        )
    swizzled = convert_sf_from_mma_layout(b_descale, m=n, k=k, num_groups=1, sf_vec_size=block_size)
    linear = linear_scales_from_swizzled_bytes(swizzled, n, k // block_size)
    return _finish(a, b, linear, alpha, out_dtype, out)


def _finish(a, b, linear_sf, alpha, out_dtype, out) -> torch.Tensor:
    m, n = int(a.shape[0]), int(b.shape[0])
    if out is not None:
        if tuple(out.shape) != (m, n):
            raise ValueError(f"out shape {tuple(out.shape)} != expected {(m, n)}")
        if out.dtype != out_dtype:
            raise TypeError(f"out dtype {out.dtype} != requested out_dtype {out_dtype}")
    scale = alpha if alpha is not None else torch.ones(1, dtype=torch.float32, device=a.device)
    result = w4a16_linear(a, b, linear_sf.view(torch.float8_e4m3fn), scale.reshape(-1)[:1].float(), out_dtype=out_dtype)
    if out is not None:
        out.copy_(result)
        return out
    return result


# The queries FlashInfer's ``@backend_requirement`` decorator attaches to ``mm_bf16_fp4`` (utils.py).
def _is_backend_supported(backend: str, cc: Optional[int] = None) -> bool:
    """``mm_bf16_fp4.is_backend_supported``: the backend exists and (``cc`` given) its requirement's
    ``@supported_compute_capability`` list holds ``cc``."""
    if backend not in _BF16_FP4_CCS:
        return False
    return cc is None or cc in _BF16_FP4_CCS[backend]


def _has_backend(backend: str) -> bool:
    """``mm_bf16_fp4.has_backend``."""
    return backend in _BF16_FP4_CCS


mm_bf16_fp4.is_backend_supported = _is_backend_supported
mm_bf16_fp4.has_backend = _has_backend
mm_bf16_fp4.has_backend_choices = lambda: True
