"""Correct-but-different dense W4A16 backends: each computes the contract by a different legal route and must pass
every check (tests/dense/test_dense_mutants.py). Re-exported by tests/dense/mutants.py, whose ``VARIANTS`` is this
module's.
"""
from __future__ import annotations

import torch

from reference_impl.format.nvfp4 import swizzle_128x4, swizzle_offsets
from tests.dense.plain import PlainDense, with_


class ReversedKOrder(PlainDense):
    """Sums the K products one by one from the last to the first, in fp32."""

    def gemm(self, x, w):
        acc = torch.zeros(x.shape[0], w.shape[0])
        for k in range(x.shape[1] - 1, -1, -1):
            acc += x[:, k : k + 1] * w[:, k]
        return acc


class Fp32DequantThenBf16Gemm(PlainDense):
    """Dequantizes ``e2m1 * e4m3 * weight_scale_2`` in fp32, rounds the weight to bf16, pre-scales the
    activations in bf16 (as engines do), runs a BF16 GEMM with fp32 accumulation, adds the bias in bf16."""

    def decode_weight(self, layer):
        return (super().decode_weight(layer) * super().alpha(layer)).bfloat16()

    def alpha(self, layer):
        return torch.tensor(1.0)

    def prescale(self, x, layer):
        x = x.reshape(-1, x.shape[-1])
        return x if layer.pre_quant_scale is None else x * layer.pre_quant_scale

    def gemm(self, x, w):
        return x.float() @ w.float().T

    def epilogue(self, acc, layer):
        out = acc.bfloat16()
        return out if layer.bias is None else out + layer.bias


class SplitK(PlainDense):
    """Splits K into slices of 32, one fp32 GEMM per slice, partial sums added in a fixed order."""

    def gemm(self, x, w):
        parts = [x[:, s : s + 32] @ w[:, s : s + 32].T for s in range(0, x.shape[1], 32)]
        return torch.stack(parts).sum(0)


class SwizzledRoundTrip(PlainDense):
    """Stores the scales 128x4-swizzled (as FlashInfer wants them) and reads them back correctly."""

    def prepare_dense(self, layer, device):
        return layer, swizzle_128x4(layer.weight_scale)

    def run_dense(self, prepared, x):
        layer, swizzled = prepared
        n, n_sf = layer.weight_scale.shape
        raw = swizzled.view(torch.uint8).reshape(-1)[swizzle_offsets(n, n_sf)]
        return super().run_dense(with_(layer, weight_scale=raw.view(torch.float8_e4m3fn)), x)


class Fp64Accumulation(PlainDense):
    """Accumulates (and applies alpha and the bias) in fp64, then one rounding to bf16."""

    def gemm(self, x, w):
        return x.double() @ w.double().T

    def epilogue(self, acc, layer):
        out = acc * self.alpha(layer).double()
        return (out if layer.bias is None else out + layer.bias.double()).bfloat16()


class TruncatingFp32Accumulation(PlainDense):
    """Tensor-core-like accumulation: each MMA step sums a block of 16 products exactly (the wide internal
    adder) and adds it to the fp32 accumulator rounding toward zero (the adders align and truncate); then
    alpha and one round-to-nearest to bf16."""

    mma_k = 16

    def gemm(self, x, w):
        acc = torch.zeros(x.shape[0], w.shape[0], dtype=torch.float64)
        for s in range(0, x.shape[1], self.mma_k):
            block = x[:, s : s + self.mma_k].double() @ w[:, s : s + self.mma_k].double().T  # exact products
            acc = _fp32_toward_zero(acc + block)
        return acc.float()


def _fp32_toward_zero(v: torch.Tensor) -> torch.Tensor:
    """fp64 values rounded to fp32 toward zero (returned as fp64); inf and NaN stay as they are."""
    nearest = v.float()
    away = torch.isfinite(nearest) & (nearest.double().abs() > v.abs())
    return torch.where(away, torch.nextafter(nearest, torch.zeros_like(nearest)), nearest).double()


VARIANTS: tuple[type[PlainDense], ...] = (
    ReversedKOrder, Fp32DequantThenBf16Gemm, SplitK, SwizzledRoundTrip, Fp64Accumulation, TruncatingFp32Accumulation,
)

