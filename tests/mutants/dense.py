"""Dense W4A16 backends with one planted bug each (mutants), and correct-but-different ones (variants).

Every mutant is named after its bug and declares the named check (:data:`conformance.dense.checks.NAMED_CHECKS`)
expected to reject it; every variant computes the contract by a different legal route and must pass.
All of them are built from :class:`PlainDense`, whose hooks mirror the stages of a real kernel: prepare the
weight, decode it, pick alpha, pre-scale the activations, GEMM, epilogue.
"""
from __future__ import annotations

from typing import Any

import torch

from conformance.interfaces.kernel import Backend, DenseLayer
from reference_impl.nvfp4 import (
    BLOCK_SIZE,
    e2m1_decode,
    e4m3_decode,
    swizzle_128x4,
    swizzle_offsets,
    swizzled_shape,
    unpack_nibbles,
)


class PlainDense(Backend):
    """A correct, readable W4A16 layer split into overridable stages (fp32 throughout, bf16 output)."""

    name = "PlainDense"
    caught_by: str | None = None  # the named check expected to reject a mutant; None for correct ones

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.name = cls.__name__  # test ids and reports name the planted bug

    def prepare_dense(self, layer: DenseLayer, device: torch.device) -> Any:
        return layer

    def decode_weight(self, layer: DenseLayer) -> torch.Tensor:
        """``e2m1 * e4m3`` as fp32 ``[N, K]`` (exact)."""
        codes = unpack_nibbles(layer.weight)
        return e2m1_decode(codes) * e4m3_decode(layer.weight_scale).repeat_interleave(BLOCK_SIZE, dim=-1)

    def alpha(self, layer: DenseLayer) -> torch.Tensor:
        return layer.weight_scale_2.float().max()

    def prescale(self, x: torch.Tensor, layer: DenseLayer) -> torch.Tensor:
        x = x.reshape(-1, x.shape[-1]).float()
        return x if layer.pre_quant_scale is None else x * layer.pre_quant_scale.float()

    def gemm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x @ w.T

    def epilogue(self, acc: torch.Tensor, layer: DenseLayer) -> torch.Tensor:
        out = acc * self.alpha(layer)
        if layer.bias is not None:
            out = out + layer.bias.float()
        return out.bfloat16()

    def run_dense(self, prepared: DenseLayer, x: torch.Tensor) -> torch.Tensor:
        acc = self.gemm(self.prescale(x, prepared), self.decode_weight(prepared))
        return self.epilogue(acc, prepared).reshape(*x.shape[:-1], prepared.out_features)


# ----------------------------------------------------------------------------------------- mutants
class NibbleSwapped(PlainDense):
    """Reads element 2i from the high nibble and 2i+1 from the low one."""

    caught_by = "check_within_error_bound"

    def decode_weight(self, layer):
        swapped = (layer.weight >> 4) | (layer.weight << 4)
        return super().decode_weight(DenseLayer(swapped, *_rest(layer)))


class UnswizzledScalesReadAsSwizzled(PlainDense):
    """Hands the linear block scales to a kernel that indexes them with the 128x4 swizzle."""

    caught_by = "check_within_error_bound"

    def decode_weight(self, layer):
        n, n_sf = layer.weight_scale.shape
        rows, cols = swizzled_shape(n, n_sf)
        buffer = torch.zeros(rows * cols, dtype=torch.uint8)
        buffer[: n * n_sf] = layer.weight_scale.view(torch.uint8).reshape(-1)  # linear bytes, zero padded
        misread = buffer[swizzle_offsets(n, n_sf)].view(torch.float8_e4m3fn)
        return super().decode_weight(_with(layer, weight_scale=misread))


class W4A4AlphaUnderW4A16(PlainDense):
    """Folds ``input_scale * weight_scale_2`` (the W4A4 alpha) although activations are not quantized."""

    caught_by = "check_within_error_bound"

    def alpha(self, layer):
        a = super().alpha(layer)
        return a if layer.input_scale is None else a * layer.input_scale.float().max()


class PreQuantScaleDropped(PlainDense):
    """Ignores the AWQ ``pre_quant_scale``."""

    caught_by = "check_within_error_bound"

    def prescale(self, x, layer):
        return x.reshape(-1, x.shape[-1]).float()


class BiasAddedTwice(PlainDense):
    """Adds the bias in the kernel epilogue and again in the layer."""

    caught_by = "check_within_error_bound"

    def epilogue(self, acc, layer):
        out = super().epilogue(acc, layer)
        return out if layer.bias is None else out + layer.bias


class LastPartialRowBlockDropped(PlainDense):
    """Only computes whole 128-row output tiles: rows past ``(N // 128) * 128`` stay zero."""

    caught_by = "check_within_error_bound"

    def epilogue(self, acc, layer):
        out = super().epilogue(acc, layer)
        out[:, (out.shape[1] // 128) * 128 :] = 0
        return out


class BlockScaleShiftedByOne(PlainDense):
    """Applies the scale of block k to block k+1 (off-by-one in the scale index)."""

    caught_by = "check_within_error_bound"

    def decode_weight(self, layer):
        shifted = torch.roll(layer.weight_scale.view(torch.uint8), shifts=1, dims=1).view(torch.float8_e4m3fn)
        return super().decode_weight(_with(layer, weight_scale=shifted))


class Fp16Output(PlainDense):
    """Returns float16 instead of bfloat16."""

    caught_by = "check_output_dtype_and_shape"

    def epilogue(self, acc, layer):
        return super().epilogue(acc, layer).half()


class RowsBeyondMultipleOf8Unwritten(PlainDense):
    """Processes M in tiles of 8 and never writes the last partial tile (buffer was zero-filled)."""

    caught_by = "check_within_error_bound"

    def epilogue(self, acc, layer):
        out = super().epilogue(acc, layer)
        out[(out.shape[0] // 8) * 8 :] = 0
        return out


class NondeterministicStochasticRounding(PlainDense):
    """Rounds the output to bf16 stochastically with a fresh random draw per call: each run is within the
    error bound, but two runs differ bitwise."""

    caught_by = "check_deterministic"

    def epilogue(self, acc, layer):
        out = acc * self.alpha(layer)
        if layer.bias is not None:
            out = out + layer.bias.float()
        bits = out.contiguous().view(torch.int32)
        noise = torch.randint(0, 1 << 16, bits.shape, dtype=torch.int32)  # unseeded on purpose
        rounded = ((bits + noise) & ~0xFFFF).view(torch.float32)
        return torch.where(torch.isfinite(out), rounded, out).bfloat16()


class FirstShardScaleInsteadOfMax(PlainDense):
    """Uses ``weight_scale_2[0]`` of a fused layer instead of the max over shards."""

    caught_by = "check_within_error_bound"

    def alpha(self, layer):
        return layer.weight_scale_2.float().reshape(-1)[0]


class TransposedWeight(PlainDense):
    """Reads the ``[N, K]`` weight as if it were stored ``[K, N]`` (a transposed-layout bug)."""

    caught_by = "check_within_error_bound"

    def decode_weight(self, layer):
        w = super().decode_weight(layer)
        return w.reshape(w.shape[1], w.shape[0]).T


class NonFiniteScrubbed(PlainDense):
    """Replaces NaN/Inf in the output by finite numbers (``nan_to_num``), hiding bad activations."""

    caught_by = "check_nonfinite_policy"

    def epilogue(self, acc, layer):
        return torch.nan_to_num(super().epilogue(acc, layer), nan=0.0, posinf=0.0, neginf=0.0)


class E4M3SubnormalsFlushed(PlainDense):
    """Flushes E4M3 subnormal block scales to zero (an FTZ decode)."""

    caught_by = "check_within_error_bound"

    def decode_weight(self, layer):
        raw = layer.weight_scale.view(torch.uint8)
        subnormal = (raw & 0x78) == 0
        flushed = torch.where(subnormal, raw & 0x80, raw).view(torch.float8_e4m3fn)
        return super().decode_weight(_with(layer, weight_scale=flushed))


class Fp16Activations(PlainDense):
    """Converts the BF16 activations to FP16 before the GEMM (an FP16 kernel reused for W4A16): exact inside
    [2^-14, 65504], inf beyond, bits lost or flushed below."""

    caught_by = "check_within_error_bound"

    def prescale(self, x, layer):
        return super().prescale(x.half(), layer)


class Bf16SplitKPartials(PlainDense):
    """Split-K with the partial sums stored in BF16 (the workspace in the output dtype): one extra rounding of
    each partial before the final sum. Within the error bound; not a single rounding."""

    caught_by = "check_correctly_rounded"

    def gemm(self, x, w):
        half = x.shape[1] // 2
        return (x[:, :half] @ w[:, :half].T).bfloat16().float() + (x[:, half:] @ w[:, half:].T).bfloat16().float()


class TruncatingOutputConversion(PlainDense):
    """Converts the fp32 result to BF16 by dropping the low 16 bits (round toward zero) instead of rounding to
    nearest. Within the error bound; biased toward zero."""

    caught_by = "check_rounding_direction"

    def epilogue(self, acc, layer):
        out = acc * self.alpha(layer)
        if layer.bias is not None:
            out = out + layer.bias.float()
        return _truncate_to_bf16(out)


def _truncate_to_bf16(v: torch.Tensor) -> torch.Tensor:
    bits = v.contiguous().view(torch.int32) & ~0xFFFF
    return torch.where(torch.isfinite(v), bits.view(torch.float32), v).bfloat16()


MUTANTS: tuple[type[PlainDense], ...] = (
    NibbleSwapped,
    UnswizzledScalesReadAsSwizzled,
    W4A4AlphaUnderW4A16,
    PreQuantScaleDropped,
    BiasAddedTwice,
    LastPartialRowBlockDropped,
    BlockScaleShiftedByOne,
    Fp16Output,
    RowsBeyondMultipleOf8Unwritten,
    NondeterministicStochasticRounding,
    FirstShardScaleInsteadOfMax,
    TransposedWeight,
    NonFiniteScrubbed,
    E4M3SubnormalsFlushed,
    Fp16Activations,
    Bf16SplitKPartials,
    TruncatingOutputConversion,
)


# ----------------------------------------------------------------------------------------- correct variants
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
        return super().run_dense(_with(layer, weight_scale=raw.view(torch.float8_e4m3fn)), x)


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


def _rest(layer: DenseLayer) -> tuple:
    return (layer.weight_scale, layer.weight_scale_2, layer.shard_sizes, layer.input_scale,
            layer.pre_quant_scale, layer.bias)


def _with(layer: DenseLayer, **changes) -> DenseLayer:
    from dataclasses import replace

    return replace(layer, **changes)
