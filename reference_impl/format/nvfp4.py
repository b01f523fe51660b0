"""The NVFP4 format: E2M1 codes, E4M3 block scales, nibble packing, the two quantization recipes,
dequantization, the 128x4 scale swizzle and the fused gate/up (W13) row layouts.

Everything is vectorised PyTorch and runs on whatever device its inputs live on.
Conventions (docs/contracts.md section 1):

* E2M1 code: bit 3 = sign, bits 0-2 index ``E2M1_MAGNITUDES``. Encoding rounds to nearest, ties to the
  even code, and saturates (|x| > 6 -> 6). NaN encodes as +6 (code 7), as the hardware's
  ``cvt.rn.satfinite.e2m1`` does.
* Packing: two codes per byte along K, element 2i in the low nibble.
* Block scale: one ``float8_e4m3fn`` per 16 consecutive K elements, linear layout ``[N, K/16]``.
* Global scale: the *decode* scale ``weight_scale_2`` (``w = e2m1 * e4m3 * weight_scale_2``, ModelOpt) or the
  *encode* scale ``global_sf = 448 * 6 / amax`` (FlashInfer). :func:`decode_to_encode_scale` converts.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK_SIZE = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
FLOAT32_MAX = torch.finfo(torch.float32).max
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Midpoints between consecutive magnitudes; a value exactly on midpoint k rounds to the even code of k, k+1.
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_TIE_ROUNDS_UP = (False, True, False, True, False, True, False)  # True where code k+1 is even

SWIZZLE_ROWS = 128
SWIZZLE_COLS = 4


def _table(values, device, dtype=torch.float32) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=device)


# ----------------------------------------------------------------------------------------- E2M1
def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """Round ``x`` to E2M1 codes (uint8, 0..15): nearest, ties to even code, saturating; NaN -> +6."""
    xf = x.float()
    mag = xf.abs()
    mids = _table(_E2M1_MIDPOINTS, xf.device)
    below = torch.bucketize(mag, mids, right=False)  # midpoints strictly below |x|
    on_mid = mag.unsqueeze(-1) == mids
    tie_up = (on_mid & _table(_TIE_ROUNDS_UP, xf.device, torch.bool)).any(-1)
    code = (below + tie_up.to(below.dtype)).clamp_(max=7).to(torch.uint8)
    sign = torch.signbit(xf).to(torch.uint8) << 3
    code = code | sign
    return torch.where(torch.isnan(xf), torch.full_like(code, 7), code)


def e2m1_decode(codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """E2M1 codes (any integer dtype, 0..15) to values; code 8 is -0."""
    c = codes.to(torch.int64)
    mag = _table(E2M1_MAGNITUDES, codes.device, dtype)[c & 7]
    return torch.where((c & 8) != 0, -mag, mag)


# ----------------------------------------------------------------------------------------- E4M3
def e4m3_encode(x: torch.Tensor) -> torch.Tensor:
    """Round to ``float8_e4m3fn``: nearest-even, saturating at +-448 (no inf in the format); NaN stays NaN."""
    xf = x.float()
    return xf.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def e4m3_decode(scales: torch.Tensor) -> torch.Tensor:
    """``float8_e4m3fn`` (or its raw uint8 bytes) to float32."""
    if scales.dtype == torch.uint8:
        scales = scales.view(torch.float8_e4m3fn)
    return scales.float()


# ----------------------------------------------------------------------------------------- packing
def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """``[..., K]`` codes -> ``[..., K/2]`` bytes, element 2i in the low nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"cannot pack an odd number of codes along K ({codes.shape[-1]})")
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """``[..., K/2]`` bytes -> ``[..., K]`` codes (uint8)."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed NVFP4 data must be uint8, got {packed.dtype}")
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


# ----------------------------------------------------------------------------------------- recipes
@dataclass(frozen=True)
class NVFP4Weight:
    """An NVFP4 tensor in checkpoint form: packed codes ``[N, K/2]`` uint8, linear block scales
    ``[N, K/16]`` float8_e4m3fn, and the decode global scale ``weight_scale_2`` (fp32 0-d tensor)."""

    packed: torch.Tensor
    block_scale: torch.Tensor
    weight_scale_2: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape[0], self.packed.shape[1] * 2

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self.packed, self.block_scale, self.weight_scale_2, dtype)


def _blocks(x: torch.Tensor) -> torch.Tensor:
    if x.dim() < 1 or x.shape[-1] % BLOCK_SIZE:
        raise ValueError(f"K = {x.shape[-1] if x.dim() else None} is not a multiple of {BLOCK_SIZE}")
    return x.float().reshape(*x.shape[:-1], x.shape[-1] // BLOCK_SIZE, BLOCK_SIZE)


def _block_amax(xb: torch.Tensor) -> torch.Tensor:
    # NaN elements are ignored by the amax, as the kernels' max.f32 tree does.
    return torch.nan_to_num(xb.abs(), nan=0.0).amax(dim=-1)


def _ieee_div(a: torch.Tensor, b: torch.Tensor | float) -> torch.Tensor:
    """Correctly rounded ``a / b``. PyTorch's CUDA kernels turn division by a CPU scalar (a Python number or
    a 0-d CPU tensor) into multiplication by its reciprocal, which can differ by one ulp; a divisor living on
    ``a``'s device keeps the IEEE division, so CPU and CUDA results agree bit for bit."""
    return a / torch.as_tensor(b, dtype=a.dtype).to(a.device).expand_as(a)


def decode_scale_from_amax(amax: torch.Tensor | float) -> torch.Tensor:
    """ModelOpt's ``weight_scale_2 = amax / (6 * 448)`` as fp32."""
    amax = torch.as_tensor(amax, dtype=torch.float32)
    return _ieee_div(amax, E2M1_MAX * E4M3_MAX)


def decode_to_encode_scale(weight_scale_2: torch.Tensor | float) -> torch.Tensor:
    """FlashInfer's ``global_sf`` from ModelOpt's ``weight_scale_2`` (their reciprocal)."""
    return 1.0 / torch.as_tensor(weight_scale_2, dtype=torch.float32)


#: ModelOpt clamps ideal block scales into E4M3's range before the cast: below it to the smallest
#: subnormal 2^-9 (never to 0), above it to 448 (``_cast_per_block_scale_to_fp8``).
MODELOPT_MIN_BLOCK_SCALE = 2.0**-9


def quantize_modelopt(w: torch.Tensor, weight_scale_2: torch.Tensor | float | None = None) -> NVFP4Weight:
    """NVIDIA ModelOpt 0.47.0's NVFP4 weight quantizer (``NVFP4QTensor.get_weights_scaling_factor`` and
    ``NVFP4QTensor.quantize``, the path its Hugging Face export takes), byte for byte, in fp32:

    * ``weight_scale_2 = amax / 2688`` (when not given; a fused layer passes the shared one);
    * ``sf = amax_block / (6 * weight_scale_2)`` -- this operation order: ``6 * ws2`` is rounded first, and
      it decides E4M3 rounding ties; an ``sf`` of exactly 0 (an all-zero block) becomes 1.0; then
      ``sf = e4m3(clamp(sf, 2^-9, 448))`` (scales below E4M3's range are clamped up, not flushed);
    * ``q = e2m1(x / (sf * weight_scale_2))``, nearest, ties to even, saturating; the sign bit is set for
      values ``< 0`` only, so ``-0.0`` encodes as code 0 (``e2m1_encode`` gives 8, the hardware's choice).

    One documented divergence (docs/format.md): where ``sf * weight_scale_2`` is 0 -- an all-zero tensor
    (``weight_scale_2 = 0``) -- ModelOpt computes 0/0 and writes NaN scales and code 7; here the blocks get
    ModelOpt's zero-block scale 1.0 and code 0, so the tensor still decodes to zeros.
    Non-finite weights are out of scope (ModelOpt's amax propagates NaN; here NaN is ignored in amaxes)."""
    if w.dim() != 2:
        raise ValueError(f"expected a 2-D weight [N, K], got shape {tuple(w.shape)}")
    xb = _blocks(w)
    if weight_scale_2 is None:
        weight_scale_2 = decode_scale_from_amax(torch.nan_to_num(w.float().abs(), nan=0.0).amax())
    ws2 = torch.as_tensor(weight_scale_2, dtype=torch.float32, device=w.device).reshape(())
    if not bool(torch.isfinite(ws2)) or float(ws2) < 0:
        raise ValueError(f"weight_scale_2 must be finite and >= 0, got {float(ws2)!r}")
    block_amax = _block_amax(xb)
    unrounded = _ieee_div(block_amax, ws2 * E2M1_MAX)
    unrounded = torch.where(block_amax == 0, torch.zeros_like(unrounded), unrounded)  # 0/0 of an all-zero tensor
    unrounded = torch.where(unrounded == 0, torch.ones_like(unrounded), unrounded)
    sf = e4m3_encode(unrounded.clamp(min=MODELOPT_MIN_BLOCK_SCALE))
    denom = sf.float().unsqueeze(-1) * ws2
    scaled = xb / denom
    scaled = torch.where((denom == 0) & (xb == 0), torch.zeros_like(scaled), scaled)
    codes = e2m1_encode(scaled)
    codes = torch.where(scaled < 0, codes | 8, codes & 7).reshape(w.shape)
    return NVFP4Weight(pack_nibbles(codes), sf, ws2.clone())


def quantize_kernel(x: torch.Tensor, global_sf: torch.Tensor | float) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashInfer/TransformerEngine kernel recipe (docs/contracts.md section 1), in the kernel's operation order:
    ``sf = e4m3(amax * (global_sf * (1/6)))``, ``inv = min(1 / (sf * (1/global_sf)), FLT_MAX)``,
    ``q = e2m1(x * inv)``. Returns (packed ``[.., K/2]`` uint8, linear scales ``[.., K/16]`` e4m3)."""
    xb = _blocks(x)
    gs = torch.as_tensor(global_sf, dtype=torch.float32, device=x.device).reshape(())
    sixth = torch.tensor(1.0 / 6.0, dtype=torch.float32, device=x.device)
    sf = e4m3_encode(_block_amax(xb) * (gs * sixth))
    inv = torch.clamp(1.0 / (sf.float() * (1.0 / gs)), max=FLOAT32_MAX)
    codes = e2m1_encode(xb * inv.unsqueeze(-1)).reshape(x.shape)
    return pack_nibbles(codes), sf


def _e2m1_as_e4m3_bytes(packed: torch.Tensor) -> torch.Tensor:
    """``[..., K/2]`` packed codes -> ``[..., K/2, 2]`` ``float8_e4m3fn`` holding ``e2m1 * 2^-6`` exactly.

    An E2M1 code ``s e1 e0 m`` (bias 1) placed as the E4M3 byte ``s 0 0 e1 e0 m 0 0`` (bias 7) keeps its
    sign, exponent field and mantissa bit, so its value is the E2M1 value times ``2^(1-7) = 2^-6``; the
    E2M1 subnormal (``e = 0``: 0 and 0.5) lands on the E4M3 subnormals (``m * 2^-7``), so the identity holds
    for all 16 codes, -0 included. Pure elementwise byte arithmetic: no per-element table gather."""
    lo = ((packed & 0x08) << 4) | ((packed & 0x07) << 2)
    hi = (packed & 0x80) | ((packed & 0x70) >> 2)
    return torch.stack((lo, hi), dim=-1).view(torch.float8_e4m3fn)


#: Weight elements decoded per step by :func:`codes_times_block_scales` (bounds its temporaries).
DECODE_CHUNK_ELEMENTS = 1 << 26


def codes_times_block_scales(
    packed: torch.Tensor, block_scale: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``e2m1 * e4m3`` (``weight_scale_2`` not applied) as **bfloat16** ``[..., N, K]``, exactly.

    Why bf16 is exact: an E2M1 magnitude (0.5 .. 6) has at most 2 significant bits; an E4M3 scale has at
    most 4 (normal: ``(1 + m/8) 2^(E-7)``, 2^-6 .. 448) or at most 3 (subnormal: ``m 2^-9``, m = 1..7);
    their product has at most 6 significant bits and a magnitude in ``[2^-1 * 2^-9, 6 * 448] = [2^-10,
    2688]``, well inside bf16's normal range, and bf16 carries 8 significant bits. So every product is
    representable and the bf16 multiply rounds nothing. Computed as ``(e2m1 * 2^-6 as E4M3 -> bf16) *
    (e4m3 -> bf16) * 64`` (both conversions exact, 64 a power of two; the scaled block scale stays in
    ``[2^-3, 28672]``). A NaN block scale (0x7F/0xFF) gives NaN, as in any dequantization. Decodes
    :data:`DECODE_CHUNK_ELEMENTS` at a time into ``out`` (allocated when not given): the extra memory
    beyond the bf16 result is one chunk's temporaries."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed NVFP4 data must be uint8, got {packed.dtype}")
    *lead, n, half_k = packed.shape
    k = half_k * 2
    if k % BLOCK_SIZE or tuple(block_scale.shape) != (*lead, n, k // BLOCK_SIZE):
        raise ValueError(
            f"block scale shape {tuple(block_scale.shape)} does not match packed weight {tuple(packed.shape)} "
            f"(expected {(*lead, n, k // BLOCK_SIZE)})"
        )
    if block_scale.dtype == torch.uint8:
        block_scale = block_scale.view(torch.float8_e4m3fn)
    rows = packed.reshape(-1, half_k)
    scales = block_scale.reshape(-1, k // BLOCK_SIZE)
    if out is None:
        out = torch.empty(*lead, n, k, dtype=torch.bfloat16, device=packed.device)
    flat = out.view(-1, k // BLOCK_SIZE, BLOCK_SIZE)
    step = max(1, DECODE_CHUNK_ELEMENTS // k)
    for start in range(0, rows.shape[0], step):
        stop = min(start + step, rows.shape[0])
        values = _e2m1_as_e4m3_bytes(rows[start:stop]).view(stop - start, k // BLOCK_SIZE, BLOCK_SIZE)
        scale = scales[start:stop].to(torch.bfloat16).mul_(64.0).unsqueeze(-1)
        torch.mul(values.to(torch.bfloat16), scale, out=flat[start:stop])
    return out


def dequantize(
    packed: torch.Tensor,
    block_scale: torch.Tensor,
    weight_scale_2: torch.Tensor | float,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``e2m1 * e4m3 * weight_scale_2`` from packed codes and *linear* block scales.
    ``e2m1 * e4m3`` is exact in bf16 and fp32 (:func:`codes_times_block_scales`); the product with
    ``weight_scale_2`` is one fp32 rounding, then one cast to ``dtype``."""
    values = codes_times_block_scales(packed, block_scale).float()
    ws2 = torch.as_tensor(weight_scale_2, dtype=torch.float32, device=packed.device)
    if ws2.dim() == 1 and values.dim() == 3:  # per-expert scales
        ws2 = ws2.view(-1, 1, 1)
    return (values * ws2).to(dtype)


# ----------------------------------------------------------------------------------------- 128x4 swizzle
def _ceil_to(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def swizzled_shape(rows: int, scale_cols: int) -> tuple[int, int]:
    """Padded shape of a 128x4-swizzled scale tensor: rows to 128, scale columns to 4."""
    return _ceil_to(rows, SWIZZLE_ROWS), _ceil_to(scale_cols, SWIZZLE_COLS)


def swizzle_offsets(rows: int, scale_cols: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Byte offset of logical scale (n, k) in the 128x4 layout, ``[rows, scale_cols]`` int64:
    ``((n//128)*ceil(K_sf/4) + k//4)*512 + (n%32)*16 + ((n%128)//32)*4 + k%4``."""
    n = torch.arange(rows, device=device).view(-1, 1)
    k = torch.arange(scale_cols, device=device).view(1, -1)
    col_tiles = _ceil_to(scale_cols, SWIZZLE_COLS) // SWIZZLE_COLS
    return ((n // 128) * col_tiles + k // 4) * 512 + (n % 32) * 16 + ((n % 128) // 32) * 4 + k % 4


def swizzle_128x4(scales: torch.Tensor) -> torch.Tensor:
    """Linear ``[..., N, K/16]`` scales -> 128x4 swizzled ``[..., ceil128(N), ceil4(K/16)]``, zero padded.
    Same dtype as the input (uint8 bytes or float8_e4m3fn); leading dims (experts) are kept."""
    *lead, rows, cols = scales.shape
    raw = scales.view(torch.uint8) if scales.dtype != torch.uint8 else scales
    pr, pc = swizzled_shape(rows, cols)
    out = torch.zeros(*lead, pr * pc, dtype=torch.uint8, device=scales.device)
    idx = swizzle_offsets(rows, cols, scales.device).reshape(-1)
    out[..., idx] = raw.reshape(*lead, rows * cols)
    return out.view(*lead, pr, pc).view(scales.dtype)


def unswizzle_128x4(swizzled: torch.Tensor, rows: int, scale_cols: int) -> torch.Tensor:
    """Inverse of :func:`swizzle_128x4`: the logical ``[..., rows, scale_cols]`` scales (padding dropped)."""
    pr, pc = swizzled_shape(rows, scale_cols)
    *lead, r, c = swizzled.shape
    if r * c != pr * pc:
        raise ValueError(f"swizzled scales hold {r * c} bytes per matrix, expected {pr}x{pc} for {rows}x{scale_cols}")
    raw = swizzled.view(torch.uint8) if swizzled.dtype != torch.uint8 else swizzled
    idx = swizzle_offsets(rows, scale_cols, swizzled.device).reshape(-1)
    return raw.reshape(*lead, pr * pc)[..., idx].view(*lead, rows, scale_cols).view(swizzled.dtype)


# ----------------------------------------------------------------------------------------- W13 layouts
W13_CHUNK_ROWS = 64


def deinterleave_gate_up(w13: torch.Tensor) -> torch.Tensor:
    """Row-interleaved ``[g0, u0, g1, u1, ...]`` -> halves ``[gate; up]`` (rows are dim -2)."""
    return torch.cat((w13[..., 0::2, :], w13[..., 1::2, :]), dim=-2)


def interleave_gate_up(w13: torch.Tensor) -> torch.Tensor:
    """Halves ``[gate; up]`` -> row-interleaved ``[g0, u0, g1, u1, ...]``."""
    half = w13.shape[-2] // 2
    gate, up = w13[..., :half, :], w13[..., half:, :]
    return torch.stack((gate, up), dim=-2).flatten(-3, -2)


def to_cutedsl_w13(w13: torch.Tensor, chunk_rows: int = W13_CHUNK_ROWS) -> torch.Tensor:
    """Halves ``[gate; up]`` -> the CuTe DSL MoE order: ``[up; gate]`` interleaved in ``chunk_rows`` chunks
    (up[0:64], gate[0:64], up[64:128], gate[64:128], ...). Works for weights and linear scales."""
    half = w13.shape[-2] // 2
    if half % chunk_rows:
        raise ValueError(f"intermediate size {half} is not a multiple of {chunk_rows}")
    gate, up = w13[..., :half, :], w13[..., half:, :]
    lead, cols = w13.shape[:-2], w13.shape[-1]
    chunks = torch.stack(
        (up.reshape(*lead, half // chunk_rows, chunk_rows, cols), gate.reshape(*lead, half // chunk_rows, chunk_rows, cols)),
        dim=-3,
    )
    return chunks.reshape(*lead, 2 * half, cols)


def from_cutedsl_w13(w13: torch.Tensor, chunk_rows: int = W13_CHUNK_ROWS) -> torch.Tensor:
    """Inverse of :func:`to_cutedsl_w13`: back to halves ``[gate; up]``."""
    half = w13.shape[-2] // 2
    if half % chunk_rows or w13.shape[-2] % 2:
        raise ValueError(f"intermediate size {w13.shape[-2] / 2:g} is not a multiple of {chunk_rows}")
    lead, cols = w13.shape[:-2], w13.shape[-1]
    chunks = w13.reshape(*lead, half // chunk_rows, 2, chunk_rows, cols)
    up = chunks[..., 0, :, :].reshape(*lead, half, cols)
    gate = chunks[..., 1, :, :].reshape(*lead, half, cols)
    return torch.cat((gate, up), dim=-2)
