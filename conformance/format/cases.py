"""NVFP4 format conformance cases, as data (docs/contracts.md section 1).

Every expected value is derived here from the format's definition, never from the code under test:
E2M1/E4M3 values from their bit fields (:mod:`conformance.format.oracles`), rounding ties from "the midpoint of two
neighbouring values goes to the one with the even code (mantissa LSB 0)", swizzle offsets from the formula of docs/contracts.md section 1 and
from the tile picture, W13 row orders from their written-out descriptions.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from conformance.format.inputs import ADVERSARIAL_FAMILIES
from conformance.format.oracles import E2M1_VALUES, E4M3_VALUES, FLT_MAX

E4M3_NAN_BYTES = (0x7F, 0xFF)


def _f32(x: float) -> float:
    return float(np.float32(x))


def _next_up(x: float) -> float:
    return float(np.nextafter(np.float32(x), np.float32(np.inf)))


def _next_down(x: float) -> float:
    return float(np.nextafter(np.float32(x), np.float32(-np.inf)))


# ----------------------------------------------------------------------------------------- encode cases
@dataclass(frozen=True)
class EncodeCase:
    """``values`` (float32) must encode to ``expected``; an entry of ``expected`` is one code/byte or a tuple of
    acceptable ones (E4M3 NaN may be 0x7F or 0xFF)."""

    id: str
    format: str  # "e2m1" or "e4m3"
    values: tuple[float, ...]
    expected: tuple[int | tuple[int, ...], ...]
    why: str
    tier: str = "cpu"


def _e2m1_cases() -> list[EncodeCase]:
    cases = []
    for code in range(16):
        v = E2M1_VALUES[code]
        cases.append(EncodeCase(f"e2m1-exact-code{code}", "e2m1", (v,), (code,), f"{v} is exactly code {code}"))
    # Ties. Positive magnitudes by code: 0:0, 1:0.5, 2:1, 3:1.5, 4:2, 5:3, 6:4, 7:6. The midpoint of codes k, k+1
    # rounds to the even one of the two (round-to-nearest-even on the code = on the mantissa bit):
    #   0.25 (0|0.5) -> 0    0.75 (0.5|1) -> 2    1.25 (1|1.5) -> 2    1.75 (1.5|2) -> 4
    #   2.5  (2|3)   -> 4    3.5  (3|4)   -> 6    5    (4|6)   -> 6
    ties = {0.25: 0, 0.75: 2, 1.25: 2, 1.75: 4, 2.5: 4, 3.5: 6, 5.0: 6}
    for k in range(7):
        lo, hi = E2M1_VALUES[k], E2M1_VALUES[k + 1]
        mid = (lo + hi) / 2
        even = k if k % 2 == 0 else k + 1
        assert ties[mid] == even, "tie table disagrees with the bit-field definition"
        cases.append(EncodeCase(f"e2m1-tie-{mid}", "e2m1", (mid, -mid), (even, even | 8),
                                f"{mid} is halfway between codes {k} and {k + 1}: ties go to the even code"))
        cases.append(EncodeCase(f"e2m1-below-tie-{mid}", "e2m1", (_next_down(mid), -_next_down(mid)), (k, k | 8),
                                "one ulp below a midpoint rounds down"))
        cases.append(EncodeCase(f"e2m1-above-tie-{mid}", "e2m1", (_next_up(mid), -_next_up(mid)), (k + 1, (k + 1) | 8),
                                "one ulp above a midpoint rounds up"))
    big = (_next_up(6.0), 6.5, 7.0, 1e30, FLT_MAX, math.inf)
    cases.append(EncodeCase("e2m1-saturate-positive", "e2m1", big, (7,) * len(big), "|x| > 6 saturates to +6 (code 7)"))
    cases.append(EncodeCase("e2m1-saturate-negative", "e2m1", tuple(-v for v in big), (15,) * len(big),
                            "x < -6 saturates to -6 (code 15)"))
    cases.append(EncodeCase("e2m1-signed-zero", "e2m1", (0.0, -0.0), (0, 8), "-0 is code 8 (sign bit alone)"))
    tiny = (1e-30, 1e-45, 0.1, 0.25)
    cases.append(EncodeCase("e2m1-negative-rounds-to-minus-zero", "e2m1", tuple(-v for v in tiny), (8,) * len(tiny),
                            "a negative value rounding to zero keeps its sign: code 8"))
    cases.append(EncodeCase("e2m1-nan-is-plus-six", "e2m1", (math.nan, -math.nan), (7, 7),
                            "NaN encodes as +6 (code 7), as cvt.rn.satfinite.e2m1x2.f32 does"))
    return cases


def _e4m3_cases() -> list[EncodeCase]:
    finite = [b for b in range(256) if b not in E4M3_NAN_BYTES]
    cases = [EncodeCase("e4m3-exact-all-finite-bytes", "e4m3", tuple(E4M3_VALUES[b] for b in finite), tuple(finite),
                        "every finite E4M3 value encodes to its own byte (0x80 = -0)")]
    positive = list(range(0x00, 0x7F))  # ascending positive values 0 .. 448
    mids, even, below, above, lo_b, hi_b = [], [], [], [], [], []
    for lo, hi in zip(positive, positive[1:]):
        mid = (E4M3_VALUES[lo] + E4M3_VALUES[hi]) / 2  # exact in float32 (5 significant bits)
        assert _f32(mid) == mid
        mids.append(mid)
        even.append(lo if lo % 2 == 0 else hi)  # byte LSB is the mantissa LSB
        lo_b.append(lo)
        hi_b.append(hi)
        below.append(_next_down(mid))
        above.append(_next_up(mid))
    cases += [
        EncodeCase("e4m3-ties-positive", "e4m3", tuple(mids), tuple(even),
                   "a midpoint between neighbouring values goes to the even mantissa"),
        EncodeCase("e4m3-ties-negative", "e4m3", tuple(-m for m in mids), tuple(b | 0x80 for b in even),
                   "negative midpoints: same, with the sign bit"),
        EncodeCase("e4m3-below-ties", "e4m3", tuple(below), tuple(lo_b), "one ulp below a midpoint rounds down"),
        EncodeCase("e4m3-above-ties", "e4m3", tuple(above), tuple(hi_b), "one ulp above a midpoint rounds up"),
    ]
    sub = math.ldexp(1, -9)  # smallest subnormal, byte 0x01
    cases.append(EncodeCase(
        "e4m3-subnormals", "e4m3",
        tuple(k * sub for k in range(1, 8)) + (sub / 2, _next_up(sub / 2), sub / 4, 1e-30),
        tuple(range(1, 8)) + (0x00, 0x01, 0x00, 0x00),
        "subnormals are k * 2^-9 (bytes 1..7); 2^-10 is the tie between 0 and 2^-9 -> 0 (even); below it -> 0",
    ))
    cases.append(EncodeCase(
        "e4m3-smallest-normal", "e4m3", (math.ldexp(1, -6), math.ldexp(15, -10)), (0x08, 0x08),
        "2^-6 is byte 0x08; 7.5 * 2^-9 is the tie between 7 * 2^-9 (0x07) and 2^-6 (0x08) -> even 0x08",
    ))
    big = (448.0, 449.0, 464.0, 480.0, 1e6, FLT_MAX, math.inf)
    cases.append(EncodeCase("e4m3-max-and-saturation", "e4m3", big, (0x7E,) * len(big),
                            "448 = 0x7E is the largest finite value; larger values and inf saturate (satfinite)"))
    cases.append(EncodeCase("e4m3-saturation-negative", "e4m3", tuple(-v for v in big), (0xFE,) * len(big),
                            "-448 = 0xFE; more negative values and -inf saturate"))
    cases.append(EncodeCase("e4m3-signed-zero", "e4m3", (0.0, -0.0, -1e-30), (0x00, 0x80, 0x80),
                            "-0 is 0x80; a negative value rounding to zero keeps its sign"))
    cases.append(EncodeCase("e4m3-nan", "e4m3", (math.nan, -math.nan), (E4M3_NAN_BYTES, E4M3_NAN_BYTES),
                            "NaN stays NaN (0x7F or 0xFF)"))
    return cases


ENCODE_CASES = _e2m1_cases() + _e4m3_cases()


# ----------------------------------------------------------------------------------------- decode cases
@dataclass(frozen=True)
class DecodeCase:
    id: str
    format: str
    code: int
    expected: float  # from the bit fields; NaN for E4M3 0x7F/0xFF
    tier: str = "cpu"


DECODE_CASES = [DecodeCase(f"e2m1-0x{c:x}", "e2m1", c, E2M1_VALUES[c]) for c in range(16)] + [
    DecodeCase(f"e4m3-0x{b:02x}", "e4m3", b, E4M3_VALUES[b]) for b in range(256)
]


# ----------------------------------------------------------------------------------------- swizzle cases
@dataclass(frozen=True)
class SwizzleCase:
    """Scale matrix ``[*lead, rows, scale_cols]`` through the 128x4 swizzle."""

    id: str
    rows: int
    scale_cols: int
    lead: tuple[int, ...] = ()
    dtype: torch.dtype = torch.uint8
    tier: str = "cpu"


SWIZZLE_CASES = [
    SwizzleCase("one-scale", 1, 1),
    SwizzleCase("exact-tile", 128, 4),
    SwizzleCase("rows-127-cols-3", 127, 3),
    SwizzleCase("rows-129-cols-5", 129, 5),
    SwizzleCase("rows-200-cols-7", 200, 7),
    SwizzleCase("rows-33-cols-2", 33, 2),
    SwizzleCase("rows-256-cols-8", 256, 8),
    SwizzleCase("rows-300-cols-9-fp8", 300, 9, dtype=torch.float8_e4m3fn),
    SwizzleCase("rows-513-cols-33", 513, 33),
    SwizzleCase("experts-3-rows-130-cols-6", 130, 6, lead=(3,)),
]


def distinct_nonzero_bytes(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Bytes 1..255 (never 0, so zero padding is distinguishable), deterministic."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1, 256, shape, generator=gen, dtype=torch.int64).to(torch.uint8)


# ----------------------------------------------------------------------------------------- W13 cases
@dataclass(frozen=True)
class W13Case:
    """A fused gate/up tensor with ``intermediate`` rows per half and ``cols`` columns (weights or scales)."""

    id: str
    intermediate: int
    cols: int
    lead: tuple[int, ...] = ()
    tier: str = "cpu"


W13_CASES = [
    W13Case("one-chunk", 64, 4),
    W13Case("two-chunks", 128, 3),
    W13Case("three-chunks-experts", 192, 2, lead=(2,)),
]
W13_BAD_INTERMEDIATE = (96, 1)  # not a multiple of 64


def deinterleaved_order(intermediate: int) -> list[int]:
    """Rows ``[g0, u0, g1, u1, ...]`` (gate j at 2j, up j at 2j+1) rearranged into halves ``[gate; up]``."""
    return [2 * j for j in range(intermediate)] + [2 * j + 1 for j in range(intermediate)]


def cutedsl_order(intermediate: int, chunk: int = 64) -> list[int]:
    """Halves ``[gate; up]`` (gate j at row j, up j at row I + j) in the CuTe DSL order:
    up[0:64], gate[0:64], up[64:128], gate[64:128], ..."""
    order = []
    for c in range(intermediate // chunk):
        order += [intermediate + c * chunk + r for r in range(chunk)]
        order += [c * chunk + r for r in range(chunk)]
    return order


# ----------------------------------------------------------------------------------------- worked examples
@dataclass(frozen=True)
class KernelRecipeExample:
    """One 16-element block through the FlashInfer/TE kernel recipe, expected result worked out by hand."""

    id: str
    block: tuple[float, ...]
    global_sf: float
    expected_scale_byte: int
    expected_codes: tuple[int, ...]
    why: str
    tier: str = "cpu"


KERNEL_RECIPE_EXAMPLES = [
    KernelRecipeExample(
        "unit-scale", (6.0, -3.0, 0.75, 0.25, 1.25, -5.0, 0.0, -0.0) + (0.5,) * 8, 1.0, 0x38,
        (7, 13, 2, 0, 2, 14, 0, 8) + (1,) * 8,
        "amax 6, gs 1: sf = e4m3(6 * fl(1/6)) = e4m3(1.0) = 0x38 (fl(1/6)*6 rounds to 1 in fp32), inv = 1; "
        "codes: 6->7, -3->13, 0.75 tie->2, 0.25 tie->0, 1.25 tie->2, -5 tie->-4 (14), 0->0, -0->8, 0.5->1",
    ),
    KernelRecipeExample(
        "zero-block", (0.0,) * 16, 1.0, 0x00, (0,) * 16,
        "amax 0: sf = 0, inv = min(1/0, FLT_MAX) = FLT_MAX, 0 * FLT_MAX = 0 -> code 0",
    ),
    KernelRecipeExample(
        "power-of-two-scale", (12.0, 3.0, 1.0, -2.0) + (0.0,) * 12, 1.0, 0x40,
        (7, 3, 1, 10) + (0,) * 12,
        "amax 12, gs 1: sf = e4m3(12 * fl(1/6)) = e4m3(2.0) = 0x40, inv = 1/2; x * inv = 6, 1.5, 0.5, -1 "
        "-> codes 7, 3, 1, 10 (8 | 2)",
    ),
]


@dataclass(frozen=True)
class ModelOptRecipeExample:
    """One row of 16-element blocks through the ModelOpt weight recipe (NVIDIA ModelOpt 0.47.0's quantizer), the
    global amax fixed by the row itself. Every expected byte is worked out by hand in ``why``."""

    id: str
    values: tuple[float, ...]
    expected_weight_scale_2: float
    expected_scale_bytes: tuple[int, ...]
    expected_codes: tuple[int, ...]
    why: str
    tier: str = "cpu"


_Z12, _Z13, _Z14, _Z15 = (0.0,) * 12, (0.0,) * 13, (0.0,) * 14, (0.0,) * 15
MODELOPT_RECIPE_EXAMPLES = [
    ModelOptRecipeExample(
        "max-scale", (2688.0, 1344.0, -672.0, 112.0, 336.0, 0.0) + (448.0,) * 10, 1.0, (0x7E,),
        (7, 5, 11, 0, 2, 0) + (2,) * 10,
        "amax 2688 = 6 * 448: weight_scale_2 = 1, sf = e4m3(2688 / (6 * 1)) = 448 = 0x7E; x / 448 = 6, 3, -1.5, "
        "0.25 (tie -> 0), 0.75 (tie -> 1.0, code 2), 0, 1 -> codes 7, 5, 11, 0, 2, 0, 2",
    ),
    ModelOptRecipeExample(
        "division-order-decides-a-tie", (1.75,) + _Z15 + (0.005615234375, -0.001953125, 0.0029296875) + _Z13,
        float.fromhex("0x1.555556p-11"), (0x7E, 0x3C), (7,) + (0,) * 15 + (7, 12, 5) + (0,) * 13,
        "ws2 = fl(1.75 / 2688) = 0x1.555556p-11, and ModelOpt first rounds 6 * ws2 = 2^-8 exactly; block 1: "
        "0x1.7p-8 / 2^-8 = 1.4375, the exact midpoint of 1.375 (0x3B) and 1.5 (0x3C) -> even mantissa 0x3C. "
        "The other order, fl(fl(0x1.7p-8 / 6) / ws2) = 1.43749988, would give 0x3B. Codes: 1.5 * ws2 rounds to "
        "2^-10, x / 2^-10 = 5.75 (-> 6, code 7), -2 (code 12), 3 (code 5); block 0: 1.75 / (448 ws2) ~ 6 -> 7",
    ),
    ModelOptRecipeExample(
        "zero-block-gets-scale-one", (2688.0, 1344.0) + _Z14 + (0.0,) * 16, 1.0, (0x7E, 0x38), (7, 5) + (0,) * 30,
        "block 1 is all zero: its ideal scale 0 / (6 * 1) = 0 is replaced by 1.0 before the cast (ModelOpt's "
        "'set all zero values in scale to 1.0') -> 0x38, codes 0 / 1 = 0",
    ),
    ModelOptRecipeExample(
        "underflowing-scale-clamped", (2688.0,) + _Z15 + (6 * 2.0**-11, -3 * 2.0**-11) + _Z14, 1.0, (0x7E, 0x01),
        (7,) + (0,) * 15 + (3, 10) + (0,) * 14,
        "block 1: ideal scale 6 * 2^-11 / 6 = 2^-11, below half the smallest E4M3 subnormal (plain rounding gives "
        "0); ModelOpt clamps to 2^-9 first -> 0x01; x / 2^-9 = 1.5 (code 3), -0.75 (tie -> 1.0, code 10)",
    ),
    ModelOptRecipeExample(
        "minus-zero-is-code-0", (2688.0, -0.0, -112.0, 112.0) + _Z12, 1.0, (0x7E,), (7, 0, 8, 0) + (0,) * 12,
        "ModelOpt sets the sign bit for x < 0 only: -0.0 / 448 = -0.0 -> code 0, but -112 / 448 = -0.25 "
        "(tie -> 0, negative) -> code 8 (-0), +0.25 -> code 0",
    ),
    ModelOptRecipeExample(
        "all-zero-weight", (0.0,) * 16, 0.0, (0x38,), (0,) * 16,
        "amax 0: weight_scale_2 = 0; ModelOpt would compute 0 / (6 * 0) = NaN (scale 0xFF, codes 7); the reference "
        "gives the block its zero-block scale 1.0 (0x38) and codes 0, so it still decodes to 0 (docs/format.md)",
    ),
]


# ----------------------------------------------------------------------------------------- device parity
@dataclass(frozen=True)
class DeviceParityCase:
    """Run ``function`` on ``family`` (cast to ``dtype``) on CPU and on CUDA; results must be bit-identical."""

    id: str
    function: str  # "e2m1_encode" | "e4m3_encode" | "quantize_modelopt" | "quantize_kernel" | "swizzle_128x4"
    family: str
    dtype: torch.dtype = torch.float32
    tier: str = "cuda"


DEVICE_PARITY_CASES = [
    DeviceParityCase(f"{fn}-{fam}-{str(dt).removeprefix('torch.')}", fn, fam, dt)
    for fn in ("e2m1_encode", "e4m3_encode", "quantize_modelopt", "quantize_kernel")
    for fam in ADVERSARIAL_FAMILIES
    for dt in (torch.float32, torch.bfloat16)
] + [DeviceParityCase(f"swizzle_128x4-{s.id}", "swizzle_128x4", s.id, torch.uint8) for s in SWIZZLE_CASES]
