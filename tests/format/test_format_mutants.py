"""The format oracles can fail: each mutant below breaks one detail of reference_impl.format.nvfp4 (patched into the module,
so it flows through the recipes that use it) and the named checks must report a mismatch. Correct-but-different
implementations must still be accepted, and the unpatched reference passes every check (the control).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from conformance.format import cases as C
from conformance.format import inputs as I
from conformance.format import oracles as O
from conformance.format import test_format as conformance_format
from reference_impl.format import nvfp4 as F

_E2M1_VALUES = np.concatenate(list(I.E2M1_ADVERSARIAL.values()))
_E4M3_VALUES = np.concatenate(list(I.E4M3_ADVERSARIAL.values()))
_MIDS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
_MAGS = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


# ----------------------------------------------------------------------------------------- checks, by name
def _first(results) -> O.Mismatch | str | None:
    for r in results:
        if r is not None:
            return r
    return None


def _flashinfer_kernel() -> O.Mismatch | None:
    """Every adversarial family in fp32 under its canonical global scale and gs = 1 (the full sweep over dtypes and
    global scales is in test_nvfp4_oracles.py; this subset keeps the mutant runs short)."""
    def runs():
        for build in I.ADVERSARIAL_FAMILIES.values():
            x = build()
            for gs in {I.global_scales_for(x)[0], 1.0}:
                yield O.check_kernel_recipe_flashinfer(F.quantize_kernel, F.swizzle_128x4, x, gs)
    return _first(runs())


def _modelopt_numpy() -> O.Mismatch | None:
    inputs = [I.canonical_weight(), *(b() for b in I.ADVERSARIAL_FAMILIES.values())]
    return _first(O.check_modelopt_recipe(F.quantize_modelopt, x) for x in inputs)


def _conformance(test, cases) -> str | None:
    """Run a conformance test function of conformance/format/test_format.py over its cases; the first failure's message."""
    for case in cases:
        try:
            test(case)
        except AssertionError as e:
            return f"{case.id}: {e}"
    return None


CHECKS: dict[str, Callable[[], object]] = {
    "ml_dtypes-e2m1": lambda: O.check_e2m1_encode(F.e2m1_encode, _E2M1_VALUES),
    "ml_dtypes-e4m3": lambda: O.check_e4m3_encode(F.e4m3_encode, _E4M3_VALUES),
    "flashinfer-kernel": _flashinfer_kernel,
    "modelopt-numpy": _modelopt_numpy,
    "conformance-encode": lambda: _conformance(conformance_format.test_encode, C.ENCODE_CASES),
    "conformance-swizzle": lambda: _conformance(conformance_format.test_swizzle_offsets_padding_and_inverse,
                                                C.SWIZZLE_CASES),
}


# ----------------------------------------------------------------------------------------- implementations
def _sign_nan(x: torch.Tensor, mag_code: torch.Tensor, nan_code: int = 7) -> torch.Tensor:
    code = mag_code.clamp(max=7).to(torch.uint8) | (torch.signbit(x).to(torch.uint8) << 3)
    return torch.where(torch.isnan(x), torch.full_like(code, nan_code), code)


def e2m1_ties_away_from_zero(x):
    x = x.float()
    return _sign_nan(x, torch.bucketize(x.abs(), _MIDS, right=True))  # a midpoint counts as passed: rounds up


def e2m1_truncate(x):
    x = x.float()
    return _sign_nan(x, torch.bucketize(x.abs(), _MAGS, right=True) - 1)  # largest magnitude <= |x|


def e2m1_nan_as_minus_zero(x):
    x = x.float()
    return _sign_nan(x, torch.bucketize(x.abs(), _MIDS), nan_code=8)  # ml_dtypes' NaN policy, not the hardware's


def e2m1_code5_as_code6(x):
    c = e2m1_nearest_search(x)
    return torch.where((c & 7) == 5, c + 1, c)  # 3.0 (and 2.5 < |x| < 3.5) come out as 4.0: one code off


def e2m1_nearest_search(x):
    """Correct but different: nearest of the 8 magnitudes by distance; on a tie the even code wins."""
    x = x.float()
    dist = (x.abs().unsqueeze(-1) - _MAGS).abs()
    dist = torch.nan_to_num(dist, nan=0.0, posinf=float("inf"))
    best = dist.min(-1, keepdim=True).values
    candidates = dist == best
    odd_penalty = (torch.arange(8) % 2).to(torch.float32)
    code = torch.where(candidates, odd_penalty, torch.full_like(dist, 9.0)).argmin(-1)  # even among the nearest
    code = torch.where(x.abs() >= 5.0, torch.where(x.abs() > 5.0, 7, 6), code)  # 5 is the 4|6 tie; beyond it 6
    return _sign_nan(x, code)


def e4m3_overflow_to_nan(x):
    x = x.float()  # the OCP non-saturating convention (ml_dtypes' own): |x| >= 464 and inf become NaN
    return torch.where(x.abs() >= 464, torch.full_like(x, float("nan")), x).clamp(-448, 448).to(torch.float8_e4m3fn)


def e4m3_flush_subnormals(x):
    x = x.float()
    return torch.where(x.abs() < 2.0**-6, torch.zeros_like(x) * x.sign(), x).clamp(-448, 448).to(torch.float8_e4m3fn)


def e4m3_double_rounding_via_bf16(x):
    return x.float().to(torch.bfloat16).float().clamp(-448, 448).to(torch.float8_e4m3fn)


def pack_high_nibble_first(codes):
    c = codes.to(torch.uint8)
    return (c[..., 0::2] << 4) | c[..., 1::2]


def _offsets_tiles_column_major(rows, scale_cols, device="cpu"):
    n = torch.arange(rows, device=device).view(-1, 1)
    k = torch.arange(scale_cols, device=device).view(1, -1)
    row_tiles = -(-rows // 128)
    return ((n // 128) + (k // 4) * row_tiles) * 512 + (n % 32) * 16 + ((n % 128) // 32) * 4 + k % 4


def _offsets_group_and_column_swapped(rows, scale_cols, device="cpu"):
    n = torch.arange(rows, device=device).view(-1, 1)
    k = torch.arange(scale_cols, device=device).view(1, -1)
    col_tiles = -(-scale_cols // 4)
    return ((n // 128) * col_tiles + k // 4) * 512 + (n % 32) * 16 + ((n % 128) // 32) + (k % 4) * 4


def swizzle_by_tiles_impl(scales):
    """Correct but different: the tile picture (reshape/permute) instead of the offset formula."""
    return O.swizzle_by_tiles(scales.view(torch.uint8)).view(scales.dtype)


_REFERENCE_QUANTIZE_KERNEL = F.quantize_kernel


def kernel_one_scale_byte_off(x, global_sf):
    packed, sf = _REFERENCE_QUANTIZE_KERNEL(x, global_sf)
    raw = sf.view(torch.uint8).clone()
    raw[..., -1, 0] ^= 1  # one scale byte, LSB flipped
    return packed, raw.view(torch.float8_e4m3fn)


def kernel_one_code_off(x, global_sf):
    packed, sf = _REFERENCE_QUANTIZE_KERNEL(x, global_sf)
    packed = packed.clone()
    packed[..., -1, -1] ^= 0x10  # one code (the last element's) off by one bit
    return packed, sf


_REFERENCE_QUANTIZE_MODELOPT = F.quantize_modelopt


def _modelopt_with(w, weight_scale_2=None, *, divide_by_6_first=False, zero_block_scale=1.0, clamp_underflow=True,
                   minus_zero_code_8=False) -> F.NVFP4Weight:
    """The ModelOpt recipe written out with one detail switchable (each mutant flips one)."""
    xb = w.float().reshape(w.shape[0], -1, 16)
    ws2 = torch.as_tensor(weight_scale_2 if weight_scale_2 is not None
                          else w.float().abs().amax() / 2688.0, dtype=torch.float32)
    amax = xb.abs().amax(-1)
    ideal = amax / 6.0 / ws2 if divide_by_6_first else amax / (6.0 * ws2)
    ideal = torch.where(amax == 0, torch.full_like(ideal, zero_block_scale), ideal)
    if clamp_underflow:
        ideal = ideal.clamp(min=2.0**-9)
    sf = ideal.clamp(max=448.0).to(torch.float8_e4m3fn)
    scaled = xb / (sf.float().unsqueeze(-1) * ws2)
    scaled = torch.nan_to_num(scaled, nan=0.0)
    codes = F.e2m1_encode(scaled)
    if not minus_zero_code_8:
        codes = torch.where(scaled < 0, codes | 8, codes & 7)
    return F.NVFP4Weight(F.pack_nibbles(codes.reshape(w.shape)), sf, ws2)


def modelopt_division_order_swapped(w, weight_scale_2=None):
    """``(amax / 6) / ws2`` instead of ModelOpt's ``amax / (6 * ws2)``: differs at E4M3 rounding ties."""
    return _modelopt_with(w, weight_scale_2, divide_by_6_first=True)


def modelopt_zero_block_scale_0(w, weight_scale_2=None):
    return _modelopt_with(w, weight_scale_2, zero_block_scale=0.0)


def modelopt_underflow_flushed(w, weight_scale_2=None):
    """Ideal scales below E4M3's range round (to 0 or 2^-9) instead of ModelOpt's clamp to 2^-9."""
    return _modelopt_with(w, weight_scale_2, clamp_underflow=False)


def modelopt_minus_zero_code_8(w, weight_scale_2=None):
    return _modelopt_with(w, weight_scale_2, minus_zero_code_8=True)


def modelopt_written_out(w, weight_scale_2=None):
    """Correct but different: the recipe step by step (no special case for weight_scale_2 = 0, which the
    families never combine with non-zero weights)."""
    return _modelopt_with(w, weight_scale_2)


@dataclass(frozen=True)
class Mutant:
    id: str
    attribute: str  # the reference_impl.format.nvfp4 name it replaces
    replacement: Callable
    caught_by: tuple[str, ...]  # every one of these checks must report a mismatch


MUTANTS = [
    Mutant("e2m1-ties-away-from-zero", "e2m1_encode", e2m1_ties_away_from_zero,
           ("ml_dtypes-e2m1", "flashinfer-kernel", "modelopt-numpy", "conformance-encode")),
    Mutant("e2m1-truncate", "e2m1_encode", e2m1_truncate,
           ("ml_dtypes-e2m1", "flashinfer-kernel", "modelopt-numpy", "conformance-encode")),
    Mutant("e2m1-nan-as-minus-zero", "e2m1_encode", e2m1_nan_as_minus_zero, ("ml_dtypes-e2m1", "conformance-encode")),
    Mutant("e2m1-one-code-off", "e2m1_encode", e2m1_code5_as_code6,
           ("ml_dtypes-e2m1", "flashinfer-kernel", "modelopt-numpy", "conformance-encode")),
    Mutant("e4m3-overflow-to-nan", "e4m3_encode", e4m3_overflow_to_nan,
           ("ml_dtypes-e4m3", "flashinfer-kernel", "conformance-encode")),
    Mutant("e4m3-flush-subnormals", "e4m3_encode", e4m3_flush_subnormals,
           ("ml_dtypes-e4m3", "flashinfer-kernel", "modelopt-numpy", "conformance-encode")),
    Mutant("e4m3-double-rounding-via-bf16", "e4m3_encode", e4m3_double_rounding_via_bf16,
           ("ml_dtypes-e4m3", "conformance-encode")),
    Mutant("nibbles-high-first", "pack_nibbles", pack_high_nibble_first, ("flashinfer-kernel", "modelopt-numpy")),
    Mutant("swizzle-tiles-column-major", "swizzle_offsets", _offsets_tiles_column_major,
           ("flashinfer-kernel", "conformance-swizzle")),
    Mutant("swizzle-row-group-and-column-swapped", "swizzle_offsets", _offsets_group_and_column_swapped,
           ("flashinfer-kernel", "conformance-swizzle")),
    Mutant("kernel-one-scale-byte-off", "quantize_kernel", kernel_one_scale_byte_off, ("flashinfer-kernel",)),
    Mutant("kernel-one-code-off", "quantize_kernel", kernel_one_code_off, ("flashinfer-kernel",)),
    Mutant("modelopt-division-order-swapped", "quantize_modelopt", modelopt_division_order_swapped, ("modelopt-numpy",)),
    Mutant("modelopt-zero-block-scale-0", "quantize_modelopt", modelopt_zero_block_scale_0, ("modelopt-numpy",)),
    Mutant("modelopt-underflow-flushed", "quantize_modelopt", modelopt_underflow_flushed, ("modelopt-numpy",)),
    Mutant("modelopt-minus-zero-code-8", "quantize_modelopt", modelopt_minus_zero_code_8, ("modelopt-numpy",)),
]

CORRECT_BUT_DIFFERENT = [
    Mutant("e2m1-nearest-search", "e2m1_encode", e2m1_nearest_search,
           ("ml_dtypes-e2m1", "flashinfer-kernel", "modelopt-numpy", "conformance-encode")),
    Mutant("swizzle-tile-picture", "swizzle_128x4", swizzle_by_tiles_impl, ("flashinfer-kernel",)),
    Mutant("modelopt-written-out", "quantize_modelopt", modelopt_written_out, ("modelopt-numpy",)),
]


@pytest.mark.parametrize("check", CHECKS)
def test_reference_passes_check(check):
    assert (r := CHECKS[check]()) is None, r


@pytest.mark.parametrize(
    "mutant,check", [pytest.param(m, c, id=f"{m.id}-caught-by-{c}") for m in MUTANTS for c in m.caught_by]
)
def test_mutant_is_caught(mutant: Mutant, check: str, monkeypatch):
    monkeypatch.setattr(F, mutant.attribute, mutant.replacement)
    result = CHECKS[check]()
    assert result is not None, f"check {check!r} accepted mutant {mutant.id!r}"


@pytest.mark.parametrize(
    "impl,check", [pytest.param(m, c, id=f"{m.id}-accepted-by-{c}") for m in CORRECT_BUT_DIFFERENT for c in m.caught_by]
)
def test_correct_but_different_is_accepted(impl: Mutant, check: str, monkeypatch):
    monkeypatch.setattr(F, impl.attribute, impl.replacement)
    assert (r := CHECKS[check]()) is None, f"{impl.id} is correct but {check!r} rejected it: {r}"


def test_compare_bits_reports_position_and_values():
    want = torch.arange(12, dtype=torch.uint8).view(3, 4)
    got = want.clone()
    got[2, 1] = 0xAA
    m = O.compare_bits("demo", got, want)
    assert m is not None and (m.count, m.first_index, m.got, m.want) == (1, (2, 1), 0xAA, 9)
    assert O.compare_bits("demo", want, want.clone()) is None
    assert O.compare_bits("shape", want.view(4, 3), want) is not None
