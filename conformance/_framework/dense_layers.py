"""The W4A16 dense layer as a case: a :class:`DenseCase` names sizes and features; :func:`build_layer` /
:func:`build_activations` turn it into checkpoint tensors and BF16 activations, seeded from the case id, so every
run (and every backend) sees the same bytes for the same case on the same device type.

Framework, not an area: the dense kernel cases (:mod:`conformance.dense.cases`), the engine layer-code cases
(:mod:`conformance.engine_harness.cases`), the perf shapes and the cross-case diagnosis all build dense layers
this one way, and areas do not import each other.
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field
from typing import Literal

import torch

from reference_impl.format.nvfp4 import (
    BLOCK_SIZE,
    E2M1_MAX,
    E4M3_MAX,
    dequantize,
    pack_nibbles,
    quantize_modelopt,
)

from conformance.interfaces.kernel import CaseInfo, DenseLayer
from conformance._framework.cases import WithinBound
from conformance._framework.tiers import device_for_tier

WeightKind = Literal[
    "gaussian", "zero_blocks", "e4m3_max", "e4m3_subnormal", "pow2_alpha", "pow2_alpha_nonneg", "three_pow2_alpha",
]
XKind = Literal[
    "gaussian", "noncontiguous", "nonfinite", "nonneg",
    "beyond_fp16", "below_fp16_normal", "mixed_magnitudes", "channel_outliers",
]
#: Activation families whose values a W4A16 backend must keep in BF16 (no FP16 step): BF16 and FP16 share
#: nothing but [2^-14, 65504]; outside it FP16 overflows to inf or loses bits / flushes to zero.
BF16_RANGE_X_KINDS = ("beyond_fp16", "below_fp16_normal", "mixed_magnitudes", "channel_outliers")

DENSE_BOUND = WithinBound("conformance.dense.bounds.dense_error_bound")  # the name golden snapshots carry (still importable)
#: Activation amax assumed for the (ignored) W4A4 input_scale: ``input_scale = amax / (6 * 448)``.
_INPUT_AMAX = 8.0


@dataclass(frozen=True)
class DenseCase:
    """One dense W4A16 case. ``m_shape`` is the activations' leading shape; ``shards`` lists fused output
    shards as ``(rows, gain)`` (each shard quantized on its own, so its ``weight_scale_2`` scales with
    ``gain``; empty = one shard of ``n`` rows); ``input_scale``: the layer carries a W4A4 ``input_scale``
    (must be ignored under W4A16); ``expect`` names the bound outputs are judged by; ``strict_checks`` the
    single-rounding checks the case is built for (BF16-exact dequantized weights: ``conformance.dense.single_rounding``)."""

    id: str
    tier: str
    m_shape: tuple[int, ...]
    n: int
    k: int
    shards: tuple[tuple[int, float], ...] = ()
    bias: bool = False
    awq: bool = False
    weight_kind: WeightKind = "gaussian"
    x_kind: XKind = "gaussian"
    input_scale: bool = True
    expect: WithinBound = DENSE_BOUND
    strict_checks: tuple[str, ...] = field(default=(), repr=False)  # repr: keeps golden snapshots' case text

    def __post_init__(self) -> None:
        if self.k % BLOCK_SIZE:
            raise ValueError(f"case {self.id}: K = {self.k} is not a multiple of {BLOCK_SIZE}")
        if self.shards and sum(r for r, _ in self.shards) != self.n:
            raise ValueError(f"case {self.id}: shard rows {self.shards} do not sum to N = {self.n}")
        if self.x_kind == "nonfinite" and self.m < 5:
            raise ValueError(f"case {self.id}: the nonfinite pattern needs at least 5 rows")

    @property
    def m(self) -> int:
        return math.prod(self.m_shape)

    @property
    def shard_list(self) -> tuple[tuple[int, float], ...]:
        return self.shards or ((self.n, 1.0),)

    @property
    def seed(self) -> int:
        return zlib.crc32(self.id.encode())

    @property
    def features(self) -> frozenset[str]:
        f = {self.weight_kind}
        f |= {"bias"} if self.bias else set()
        f |= {"awq"} if self.awq else set()
        f |= {"fused_shards"} if len(self.shard_list) > 1 else set()
        f |= {"3d_input"} if len(self.m_shape) > 1 else set()
        f |= {"noncontiguous"} if self.x_kind == "noncontiguous" else set()
        f |= {"nonfinite"} if self.x_kind == "nonfinite" else set()
        f |= {f"x_{self.x_kind}"} if self.x_kind in (*BF16_RANGE_X_KINDS, "nonneg") else set()
        f |= {"single_rounding"} if self.strict_checks else set()
        f |= {"w4a4_input_scale"} if self.input_scale else set()
        return frozenset(f)

    @property
    def device(self) -> torch.device:
        return torch.device(device_for_tier(self.tier))

    def info(self) -> CaseInfo:
        return CaseInfo("dense", self.device, {"m": self.m, "n": self.n, "k": self.k}, self.features)


def _generator(case: DenseCase, device: torch.device, stream: int) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(case.seed * 16 + stream)
    return g


def _shard_weight(case: DenseCase, rows: int, gain: float, g: torch.Generator, device) -> tuple:
    """(packed, linear scales, weight_scale_2) of one shard, by ``case.weight_kind``."""
    k = case.k
    if case.weight_kind in ("gaussian", "zero_blocks"):
        w = torch.randn(rows, k, generator=g, device=device) * gain
        if case.weight_kind == "zero_blocks":  # every 4th block zero, and the whole first row
            blocks = w.view(rows, k // BLOCK_SIZE, BLOCK_SIZE)
            blocks[:, ::4] = 0
            blocks[0] = 0
        q = quantize_modelopt(w)
        return q.packed, q.block_scale, q.weight_scale_2
    if case.weight_kind in ("pow2_alpha", "pow2_alpha_nonneg", "three_pow2_alpha"):
        # weight_scale_2 a power of two (>= amax / 2688, so no scale saturates): every e2m1 * e4m3 * alpha is a
        # BF16 number, so the contract's only rounding after the fp32 sum is the output's (single-rounding cases).
        # "three_pow2_alpha": 1.5 * 2^e, NOT a power of two, still BF16-exact weights (e2m1 * e4m3 has <= 6
        # significant bits, times 3 <= 8), but alpha * acc rounds: a datapath that rounds acc to BF16 before
        # the alpha multiply rounds twice, where a power-of-two alpha would hide it.
        w = torch.randn(rows, k, generator=g, device=device) * gain
        w = w.abs() if case.weight_kind == "pow2_alpha_nonneg" else w
        mantissa = 1.5 if case.weight_kind == "three_pow2_alpha" else 1.0
        ideal = float(w.abs().amax()) / (E2M1_MAX * E4M3_MAX)
        ws2 = mantissa * 2.0 ** math.ceil(math.log2(ideal / mantissa))
        q = quantize_modelopt(w, ws2)
        return q.packed, q.block_scale, q.weight_scale_2
    # Checkpoint bytes chosen directly, to reach the corners of the E4M3 range.
    codes = torch.randint(0, 16, (rows, k), generator=g, device=device, dtype=torch.uint8)
    n_sf = k // BLOCK_SIZE
    if case.weight_kind == "e4m3_max":  # half the blocks at 448 (0x7E), the rest normal 2^-1 .. 448
        raw = torch.randint(0x30, 0x7F, (rows, n_sf), generator=g, device=device, dtype=torch.uint8)
        at_max = torch.rand(rows, n_sf, generator=g, device=device) < 0.5
        raw = torch.where(at_max, torch.full_like(raw, 0x7E), raw)
        ws2 = torch.tensor(gain / (E2M1_MAX * E4M3_MAX), device=device)
    else:  # "e4m3_subnormal": every scale a subnormal (0x01..0x07 = k * 2^-9) or zero
        raw = torch.randint(0x00, 0x08, (rows, n_sf), generator=g, device=device, dtype=torch.uint8)
        ws2 = torch.tensor(gain * 64.0, device=device)
    return pack_nibbles(codes), raw.view(torch.float8_e4m3fn), ws2.float()


def build_layer(case: DenseCase, device: torch.device | str | None = None) -> DenseLayer:
    """The checkpoint tensors of ``case`` on ``device`` (default: the case's tier device)."""
    device = torch.device(device) if device is not None else case.device
    g = _generator(case, device, 0)
    packed, scales, ws2 = [], [], []
    for rows, gain in case.shard_list:
        shard_packed, shard_scales, shard_ws2 = _shard_weight(case, rows, gain, g, device)
        packed.append(shard_packed)
        scales.append(shard_scales)
        ws2.append(shard_ws2.reshape(()))
    weight, weight_scale = torch.cat(packed), torch.cat(scales)
    weight_scale_2 = torch.stack(ws2).float()
    n_shards = len(case.shard_list)
    input_scale = None
    if case.input_scale:  # one per shard, deliberately far from 1 so W4A4 alpha is visibly wrong
        input_scale = torch.tensor(
            [_INPUT_AMAX * (1 + 0.25 * i) / (E2M1_MAX * E4M3_MAX) for i in range(n_shards)], device=device
        )
    pre_quant_scale = None
    if case.awq:  # AWQ per-channel scales, log-uniform in [1/4, 4], stored bf16
        pre_quant_scale = torch.exp2(torch.rand(case.k, generator=g, device=device) * 4 - 2).bfloat16()
    bias = None
    if case.bias:  # same order of magnitude as the GEMM output: sqrt(K) * rms(weight) * rms(x' = 1)
        w_rms = float(dequantize(weight, weight_scale, weight_scale_2.max()).pow(2).mean().sqrt())
        bias = (torch.randn(case.n, generator=g, device=device) * math.sqrt(case.k) * w_rms).bfloat16()
    return DenseLayer(
        weight=weight,
        weight_scale=weight_scale,
        weight_scale_2=weight_scale_2,
        shard_sizes=tuple(r for r, _ in case.shard_list),
        input_scale=input_scale,
        pre_quant_scale=pre_quant_scale,
        bias=bias,
    )


#: (flattened row, column selector, value) planted by x_kind "nonfinite"; rows 0, 2 and 5+ stay finite.
NONFINITE_PATTERN = ((1, 5, float("nan")), (3, 0, float("inf")), (4, -1, float("-inf")))


def build_activations(case: DenseCase, device: torch.device | str | None = None) -> torch.Tensor:
    """BF16 activations ``[*m_shape, K]`` of ``case``: N(0, 1); ``noncontiguous`` = a stride-2 view along K;
    ``nonfinite`` plants :data:`NONFINITE_PATTERN` (NaN, +Inf, -Inf in three rows); ``nonneg`` = |N(0, 1)|
    (post-activation inputs: no cancellation, so the accumulation allowance stays small at large K); the
    BF16-range families are :func:`_bf16_range_family`."""
    device = torch.device(device) if device is not None else case.device
    g = _generator(case, device, 1)
    if case.x_kind == "noncontiguous":
        wide = torch.randn(*case.m_shape, 2 * case.k, generator=g, device=device).bfloat16()
        return wide[..., ::2]
    x = torch.randn(*case.m_shape, case.k, generator=g, device=device)
    if case.x_kind == "nonneg":
        x = x.abs()
    elif case.x_kind in BF16_RANGE_X_KINDS:
        x = _bf16_range_family(case.x_kind, x.view(-1, case.k), g).view_as(x)
    x = x.bfloat16()
    if case.x_kind == "nonfinite":
        flat = x.view(-1, case.k)
        for row, col, value in NONFINITE_PATTERN:
            flat[row, col] = value
    return x


#: Row scales of ``mixed_magnitudes``, cycling over the rows: 2^+-40 is far outside FP16 (2^-24 .. 65504).
MIXED_ROW_EXPONENTS = (-40, -20, 0, 20, 40)


def _bf16_range_family(kind: str, x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """``x [M, K]`` N(0, 1) reshaped into a family that is normal BF16 but not representable in FP16:

    * ``beyond_fp16``: rows 1, 2, 3 of every 4 times 2^17 (|x| up to ~6e5 > 65504), row 0 of 4 unchanged;
    * ``below_fp16_normal``: odd rows times 2^-20 (FP16 subnormals: 4-5 bits left), even rows times 2^-30
      (below FP16's smallest subnormal 2^-24: flushed to 0);
    * ``mixed_magnitudes``: row r times 2^MIXED_ROW_EXPONENTS[r % 5], every element times 2^u, u uniform in
      [-8, 8] (one row spans 2^16, the batch 2^96);
    * ``channel_outliers``: AWQ-style activation outliers: max(2, K/64) fixed channels times 2^10, one of them
      times 2^17 (beyond FP16), in every row."""
    m, k = x.shape
    rows = torch.arange(m, device=x.device).view(-1, 1)
    if kind == "beyond_fp16":
        return x * torch.where(rows % 4 == 0, 1.0, 2.0**17)
    if kind == "below_fp16_normal":
        return x * torch.where(rows % 2 == 1, 2.0**-20, 2.0**-30)
    if kind == "mixed_magnitudes":
        row_exp = torch.tensor(MIXED_ROW_EXPONENTS, device=x.device, dtype=torch.float32)[rows % len(MIXED_ROW_EXPONENTS)]
        elem_exp = torch.randint(-8, 9, (m, k), generator=g, device=x.device).float()
        return x * torch.exp2(row_exp + elem_exp)
    channels = torch.randperm(k, generator=g, device=x.device)[: max(2, k // 64)]
    gain = torch.ones(k, device=x.device)
    gain[channels] = 2.0**10
    gain[channels[0]] = 2.0**17
    return x * gain


#: Real LLM projection shapes (N, K): Llama-3-8B q/o (4096x4096), gate/up (14336x4096), down (4096x14336),
#: Llama-3-70B fused gate+up (28672x8192), and a 25600-wide down projection (5120x25600, Qwen-32B class).
LLM_SHAPES = ((4096, 4096), (14336, 4096), (4096, 14336), (28672, 8192), (5120, 25600))
