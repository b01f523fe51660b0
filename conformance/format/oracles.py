"""Independent oracles for the NVFP4 format: what the reference (``reference_impl.format.nvfp4``) is checked against.

Nothing here calls the reference. Each oracle is the format's definition written another way:

* bit-field decoders: value = sign * 2^(exponent - bias) * (1 + mantissa / 2^m) (subnormal when exponent == 0);
* rounding by ``ml_dtypes`` (an unrelated C++ implementation of ``float4_e2m1fn``/``float8_e4m3fn``), with the two
  policies where the NVFP4 hardware convention differs from ml_dtypes applied explicitly:
  E4M3 ``satfinite`` (clip to +-448 first; ml_dtypes turns |x| >= 464 into NaN) and E2M1 NaN -> +6 (code 7;
  ml_dtypes gives code 8);
* the ModelOpt weight recipe as a numpy float32 program, using the ml_dtypes conversions;
* the 128x4 swizzle as a reshape/permute of the padded scale matrix (the "tile of 32x4x4" picture), not the
  offset formula;
* :func:`compare_bits`, the one comparison every oracle test uses, so a mutant test can show it reports a mismatch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import ml_dtypes
import numpy as np
import torch

E2M1_BIAS, E2M1_MANTISSA_BITS = 1, 1
E4M3_BIAS, E4M3_MANTISSA_BITS = 7, 3


# ----------------------------------------------------------------------------------------- bit fields
def e2m1_value_from_fields(code: int) -> float:
    """E2M1 (1 sign, 2 exponent, 1 mantissa bit, bias 1, no inf/NaN) from its bit fields."""
    if not 0 <= code <= 15:
        raise ValueError(f"E2M1 code must be 0..15, got {code}")
    sign = -1.0 if code & 0b1000 else 1.0
    exponent = (code >> 1) & 0b11
    mantissa = code & 0b1
    if exponent == 0:  # subnormal: 2^(1-bias) * m/2
        magnitude = math.ldexp(mantissa / 2, 1 - E2M1_BIAS)
    else:
        magnitude = math.ldexp(1 + mantissa / 2, exponent - E2M1_BIAS)
    return math.copysign(magnitude, sign)


def e4m3_value_from_fields(byte: int) -> float:
    """float8_e4m3fn (1 sign, 4 exponent, 3 mantissa bits, bias 7) from its bit fields. Only S.1111.111 is NaN;
    there is no infinity, so S.1111.110 = 448 is the largest finite magnitude."""
    if not 0 <= byte <= 255:
        raise ValueError(f"E4M3 byte must be 0..255, got {byte}")
    sign = -1.0 if byte & 0x80 else 1.0
    exponent = (byte >> 3) & 0b1111
    mantissa = byte & 0b111
    if exponent == 0b1111 and mantissa == 0b111:
        return math.nan
    if exponent == 0:  # subnormal: 2^(1-bias) * m/8
        magnitude = math.ldexp(mantissa / 8, 1 - E4M3_BIAS)
    else:
        magnitude = math.ldexp(1 + mantissa / 8, exponent - E4M3_BIAS)
    return math.copysign(magnitude, sign)


# ----------------------------------------------------------------------------------------- ml_dtypes rounding
def e2m1_codes_ml_dtypes(x: np.ndarray) -> np.ndarray:
    """E2M1 codes of float32 ``x`` by ml_dtypes (RNE, saturating), NaN -> code 7 (the hardware's +6)."""
    x = np.asarray(x, dtype=np.float32)
    with np.errstate(invalid="ignore"):  # NaN inputs: replaced below
        codes = x.astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0xF
    return np.where(np.isnan(x), np.uint8(7), codes).astype(np.uint8)


def e4m3_bytes_ml_dtypes(x: np.ndarray) -> np.ndarray:
    """float8_e4m3fn bytes of float32 ``x`` by ml_dtypes after the satfinite clip to +-448 (NaN stays NaN)."""
    x = np.asarray(x, dtype=np.float32)
    with np.errstate(invalid="ignore"):  # NaN stays NaN, as intended
        return np.clip(x, -448.0, 448.0).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


def e4m3_values_ml_dtypes(x: np.ndarray) -> np.ndarray:
    return e4m3_bytes_ml_dtypes(x).view(ml_dtypes.float8_e4m3fn).astype(np.float32)


def pack_codes_numpy(codes: np.ndarray) -> np.ndarray:
    """Two codes per byte along the last axis, element 2i in the low nibble."""
    codes = codes.astype(np.uint8)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


@dataclass(frozen=True)
class ModelOptOracle:
    packed: np.ndarray  # [N, K/2] uint8
    scale_bytes: np.ndarray  # [N, K/16] uint8 (float8_e4m3fn bytes)
    weight_scale_2: np.float32


def modelopt_recipe_numpy(w: np.ndarray, weight_scale_2: float | None = None) -> ModelOptOracle:
    """NVIDIA ModelOpt 0.47's NVFP4 weight quantizer (``NVFP4QTensor``) as a float32 numpy program, every
    operation one IEEE float32 rounding, conversions by ml_dtypes: ``ws2 = amax / 2688`` (6 * 448 exactly),
    ``sf = block_amax / (6 * ws2)`` (``6 * ws2`` rounded first), a zero ``sf`` becomes 1.0, then
    ``sf = e4m3(clip(sf, 2^-9, 448))``; ``q = e2m1(|x / (sf * ws2)|)`` with the sign bit set only for
    values ``< 0`` (``-0.0`` gives code 0). Where ``sf * ws2`` is 0 (``ws2 = 0``) zero elements get code 0
    (the reference's documented choice; ModelOpt itself computes 0/0 there, docs/format.md)."""
    w = np.asarray(w, dtype=np.float32)
    n, k = w.shape
    blocks = w.reshape(n, k // 16, 16)
    with np.errstate(divide="ignore", invalid="ignore"):
        if weight_scale_2 is None:
            ws2 = np.float32(np.nanmax(np.abs(w))) / np.float32(2688.0)
        else:
            ws2 = np.float32(weight_scale_2)
        block_amax = np.nanmax(np.abs(blocks), axis=-1).astype(np.float32)
        sf_in = np.where(block_amax == 0, np.float32(0.0), block_amax / (np.float32(6.0) * ws2)).astype(np.float32)
        sf_in = np.where(sf_in == 0, np.float32(1.0), sf_in)
        sf_bytes = e4m3_bytes_ml_dtypes(np.clip(sf_in, np.float32(2.0**-9), np.float32(448.0)))
        sf = sf_bytes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
        denom = (sf * ws2)[..., None]
        scaled = (blocks / denom).astype(np.float32)
        scaled = np.where((denom == 0) & (blocks == 0), np.float32(0.0), scaled)
    codes = e2m1_codes_ml_dtypes(np.abs(scaled)) | np.where(scaled < 0, np.uint8(8), np.uint8(0))
    return ModelOptOracle(pack_codes_numpy(codes.reshape(n, k)), sf_bytes, np.float32(ws2))


# ----------------------------------------------------------------------------------------- 128x4 swizzle
def swizzle_by_tiles(scale_bytes: torch.Tensor) -> torch.Tensor:
    """The 128x4 layout pictured as tiles: pad ``[R, C]`` with zeros to ``[128*RT, 4*CT]``; each 128x4 tile is
    512 contiguous bytes, tiles in row-major tile order; inside a tile, row r = 32*j + i and column c are at
    ``i*16 + j*4 + c`` (i.e. the tile is stored as [32, 4(j), 4(c)])."""
    rows, cols = scale_bytes.shape
    rt, ct = -(-rows // 128), -(-cols // 4)
    padded = torch.zeros(rt * 128, ct * 4, dtype=torch.uint8)
    padded[:rows, :cols] = scale_bytes.view(torch.uint8).cpu()
    tiles = padded.view(rt, 4, 32, ct, 4)  # row = tile_row*128 + j*32 + i, col = tile_col*4 + c
    return tiles.permute(0, 3, 2, 1, 4).reshape(rt * 128, ct * 4)


def swizzle_offset_spec(n: int, k: int, scale_cols: int) -> int:
    """docs/contracts.md section 1's byte offset of logical scale (n, k), as scalar integer arithmetic."""
    col_tiles = -(-scale_cols // 4)
    return ((n // 128) * col_tiles + k // 4) * 512 + (n % 32) * 16 + ((n % 128) // 32) * 4 + k % 4


# ----------------------------------------------------------------------------------------- comparison
@dataclass(frozen=True)
class Mismatch:
    what: str
    count: int
    total: int
    first_index: tuple[int, ...]
    got: int
    want: int

    def __str__(self) -> str:
        return (
            f"{self.what}: {self.count} of {self.total} differ; first at {self.first_index}: "
            f"got 0x{self.got:02x}, want 0x{self.want:02x}"
        )


def compare_bits(what: str, got, want) -> Mismatch | None:
    """Bit-for-bit comparison of two integer (code or byte) arrays; ``None`` when identical.
    Float8 tensors are compared by their bytes. Shapes must agree (a shape difference is a mismatch too)."""
    g, w = _as_uint_numpy(got), _as_uint_numpy(want)
    if g.shape != w.shape:
        return Mismatch(f"{what} (shape {g.shape} vs {w.shape})", max(g.size, w.size), max(g.size, w.size), (), 0, 0)
    diff = g != w
    if not diff.any():
        return None
    first = tuple(int(i) for i in np.argwhere(diff)[0])
    return Mismatch(what, int(diff.sum()), int(diff.size), first, int(g[first]), int(w[first]))


def _as_uint_numpy(a) -> np.ndarray:
    if isinstance(a, torch.Tensor):
        t = a.detach().cpu()
        if t.dtype in (torch.float8_e4m3fn, torch.bool):
            t = t.view(torch.uint8) if t.dtype != torch.bool else t.to(torch.uint8)
        if t.is_floating_point():
            raise TypeError(f"compare_bits compares codes/bytes, got a {t.dtype} tensor")
        return t.numpy().astype(np.int64)
    arr = np.asarray(a)
    if arr.dtype == ml_dtypes.float8_e4m3fn:
        arr = arr.view(np.uint8)
    if arr.dtype.kind == "f":
        raise TypeError(f"compare_bits compares codes/bytes, got a {arr.dtype} array")
    return arr.astype(np.int64)


# ----------------------------------------------------------------------------------------- oracle checks
# Each check runs an implementation (the reference, or a mutant in tests/format/test_format_mutants.py) against one oracle
# and returns the first disagreement, or None. The self-tests assert None for the reference and a Mismatch for mutants.
def check_e2m1_encode(encode, x: np.ndarray) -> Mismatch | None:
    """``encode`` (float32 tensor -> uint8 codes) against ml_dtypes on ``x``."""
    got = encode(torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)))
    return compare_bits("E2M1 codes vs ml_dtypes", got, e2m1_codes_ml_dtypes(x))


def check_e4m3_encode(encode, x: np.ndarray) -> Mismatch | None:
    """``encode`` (float32 tensor -> float8_e4m3fn) against ml_dtypes (after the satfinite clip) on ``x``.
    NaN inputs must give a NaN byte (0x7F or 0xFF; ml_dtypes keeps the sign, so does torch)."""
    got = encode(torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)))
    return compare_bits("E4M3 bytes vs ml_dtypes", got, e4m3_bytes_ml_dtypes(x))


def check_modelopt_recipe(quantize_modelopt, w: torch.Tensor, weight_scale_2: float | None = None) -> Mismatch | None:
    """``quantize_modelopt(w[, ws2])`` against :func:`modelopt_recipe_numpy` (same float32 input values)."""
    q = quantize_modelopt(w) if weight_scale_2 is None else quantize_modelopt(w, weight_scale_2)
    want = modelopt_recipe_numpy(w.float().numpy(), weight_scale_2)
    got_ws2 = np.asarray(q.weight_scale_2.cpu().float().numpy(), dtype=np.float32).reshape(1).view(np.uint32)
    return (
        compare_bits("ModelOpt weight_scale_2 bits", got_ws2, np.asarray(want.weight_scale_2).reshape(1).view(np.uint32))
        or compare_bits("ModelOpt block scale bytes", q.block_scale, want.scale_bytes)
        or compare_bits("ModelOpt packed codes", q.packed, want.packed)
    )


MODELOPT_VERSION = "0.47.0"


def modelopt_package_quantize(w: torch.Tensor, weight_scale_2: float | torch.Tensor | None = None):
    """``(packed uint8, block-scale bytes uint8, weight_scale_2 fp32)`` from NVIDIA ModelOpt's own quantizer,
    the calls its Hugging Face export makes for an NVFP4 weight (``unified_export_hf._export_quantized_weight``):
    ``NVFP4QTensor.get_weights_scaling_factor`` then ``NVFP4QTensor.quantize`` with that scale. Needs
    ``nvidia-modelopt`` (installed --no-deps by ci/install-test-deps.sh; CPU only)."""
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    w = w.clone()
    if weight_scale_2 is None:
        ws2 = NVFP4QTensor.get_weights_scaling_factor_2(w)
    else:
        ws2 = torch.as_tensor(weight_scale_2, dtype=torch.float32).reshape(())
    sf, _ = NVFP4QTensor.get_weights_scaling_factor(w, 16, ws2)
    qtensor, _, _ = NVFP4QTensor.quantize(w, 16, sf, ws2)
    return qtensor._quantized_data, sf.view(torch.uint8), ws2.float()


def check_modelopt_package(quantize_modelopt, w: torch.Tensor, weight_scale_2: float | None = None) -> Mismatch | None:
    """``quantize_modelopt(w[, ws2])`` against NVIDIA ModelOpt's quantizer (:func:`modelopt_package_quantize`):
    weight_scale_2 bits, block scale bytes and packed codes, bit for bit."""
    q = quantize_modelopt(w) if weight_scale_2 is None else quantize_modelopt(w, weight_scale_2)
    packed, scale_bytes, ws2 = modelopt_package_quantize(w, weight_scale_2)
    return (
        compare_bits("weight_scale_2 bits vs ModelOpt", q.weight_scale_2.float().cpu().reshape(1).view(torch.int32),
                     ws2.reshape(1).view(torch.int32))
        or compare_bits("block scale bytes vs ModelOpt", q.block_scale, scale_bytes)
        or compare_bits("packed codes vs ModelOpt", q.packed, packed)
    )


def check_kernel_recipe_flashinfer(quantize_kernel, swizzle, x: torch.Tensor, global_sf: float) -> Mismatch | None:
    """``quantize_kernel`` + ``swizzle`` against FlashInfer's CPU model ``quantize_reference``: packed codes and
    the 128x4-swizzled scale bytes, bit for bit."""
    from flashinfer.batch_invariant.quantization.nvfp4_reference import quantize_reference

    want_packed, want_sf, _ = quantize_reference(x, global_sf)
    packed, sf = quantize_kernel(x, global_sf)
    return (
        compare_bits("kernel-recipe packed codes vs FlashInfer", packed, want_packed)
        or compare_bits("kernel-recipe swizzled scales vs FlashInfer", swizzle(sf).view(torch.uint8), want_sf)
    )


# Value tables derived from the bit fields above, shared by the format cases and input families.
FLT_MAX = float(np.finfo(np.float32).max)
E2M1_VALUES = tuple(e2m1_value_from_fields(c) for c in range(16))
E4M3_VALUES = tuple(e4m3_value_from_fields(b) for b in range(256))
