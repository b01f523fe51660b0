"""Dense W4A16 backends with one planted bug each (mutants); the correct-but-different ones (variants) are in
tests/dense/variants.py and re-exported here (``VARIANTS``: ci/write_check_docs.py and the self-tests read both
tuples from this module).

Every mutant is named after its bug and declares the named check (:data:`conformance.dense.checks.NAMED_CHECKS`)
expected to reject it; every variant computes the contract by a different legal route and must pass.
All of them are built from :class:`~tests.dense.plain.PlainDense` (tests/dense/plain.py), whose hooks mirror the
stages of a real kernel: prepare the weight, decode it, pick alpha, pre-scale the activations, GEMM, epilogue.
"""
from __future__ import annotations

import torch

from conformance.interfaces.kernel import DenseLayer
from reference_impl.format.nvfp4 import swizzle_offsets, swizzled_shape
from tests.dense.plain import PlainDense, rest, with_
from tests.dense.variants import (  # noqa: F401  (re-exported: importers name them from this module)
    VARIANTS,
    Fp32DequantThenBf16Gemm,
    Fp64Accumulation,
    ReversedKOrder,
    SplitK,
    SwizzledRoundTrip,
    TruncatingFp32Accumulation,
)


# ----------------------------------------------------------------------------------------- mutants
class NibbleSwapped(PlainDense):
    """Reads element 2i from the high nibble and 2i+1 from the low one."""

    caught_by = "check_within_error_bound"
    diagnosed_as = "nibble_swapped"

    def decode_weight(self, layer):
        swapped = (layer.weight >> 4) | (layer.weight << 4)
        return super().decode_weight(DenseLayer(swapped, *rest(layer)))


class UnswizzledScalesReadAsSwizzled(PlainDense):
    """Hands the linear block scales to a kernel that indexes them with the 128x4 swizzle."""

    caught_by = "check_within_error_bound"
    diagnosed_as = "scales_read_as_swizzled"

    def decode_weight(self, layer):
        n, n_sf = layer.weight_scale.shape
        rows, cols = swizzled_shape(n, n_sf)
        buffer = torch.zeros(rows * cols, dtype=torch.uint8)
        buffer[: n * n_sf] = layer.weight_scale.view(torch.uint8).reshape(-1)  # linear bytes, zero padded
        misread = buffer[swizzle_offsets(n, n_sf)].view(torch.float8_e4m3fn)
        return super().decode_weight(with_(layer, weight_scale=misread))


class W4A4AlphaUnderW4A16(PlainDense):
    """Folds ``input_scale * weight_scale_2`` (the W4A4 alpha) although activations are not quantized."""

    caught_by = "check_within_error_bound"
    diagnosed_as = "w4a4_alpha"

    def alpha(self, layer):
        a = super().alpha(layer)
        return a if layer.input_scale is None else a * layer.input_scale.float().max()


class GlobalScaleDropped(PlainDense):
    """Never applies ``weight_scale_2`` (alpha = 1): the output is the exact one over weight_scale_2."""

    caught_by = "check_within_error_bound"
    diagnosed_as = "global_scale_missing"

    def alpha(self, layer):
        return torch.ones((), dtype=torch.float32)


class GlobalScaleDoubled(PlainDense):
    """Applies ``weight_scale_2`` twice (folded into the decoded weights and again in the epilogue)."""

    caught_by = "check_within_error_bound"
    diagnosed_as = "global_scale_doubled"

    def alpha(self, layer):
        a = super().alpha(layer)
        return a * a


class PreQuantScaleDropped(PlainDense):
    """Ignores the AWQ ``pre_quant_scale``."""

    caught_by = "check_within_error_bound"
    diagnosed_as = ("pre_quant_scale_dropped", "awq_only")

    def prescale(self, x, layer):
        return x.reshape(-1, x.shape[-1]).float()


class BiasAddedTwice(PlainDense):
    """Adds the bias in the kernel epilogue and again in the layer."""

    caught_by = "check_within_error_bound"
    diagnosed_as = ("bias_twice", "bias_only")

    def epilogue(self, acc, layer):
        out = super().epilogue(acc, layer)
        return out if layer.bias is None else out + layer.bias


class LastPartialRowBlockDropped(PlainDense):
    """Only computes whole 128-row output tiles: rows past ``(N // 128) * 128`` stay zero."""

    caught_by = "check_within_error_bound"
    diagnosed_as = ("n_tail", "n_tail_cases")

    def epilogue(self, acc, layer):
        out = super().epilogue(acc, layer)
        out[:, (out.shape[1] // 128) * 128 :] = 0
        return out


class BlockScaleShiftedByOne(PlainDense):
    """Applies the scale of block k to block k+1 (off-by-one in the scale index)."""

    caught_by = "check_within_error_bound"
    diagnosed_as = "block_scale_shifted"

    def decode_weight(self, layer):
        shifted = torch.roll(layer.weight_scale.view(torch.uint8), shifts=1, dims=1).view(torch.float8_e4m3fn)
        return super().decode_weight(with_(layer, weight_scale=shifted))


class Fp16Output(PlainDense):
    """Returns float16 instead of bfloat16."""

    caught_by = "check_output_dtype_and_shape"

    def epilogue(self, acc, layer):
        return super().epilogue(acc, layer).half()


class RowsBeyondMultipleOf8Unwritten(PlainDense):
    """Processes M in tiles of 8 and never writes the last partial tile (buffer was zero-filled)."""

    caught_by = "check_within_error_bound"
    diagnosed_as = "m_tail"

    def epilogue(self, acc, layer):
        out = super().epilogue(acc, layer)
        out[(out.shape[0] // 8) * 8 :] = 0
        return out


class NondeterministicStochasticRounding(PlainDense):
    """Rounds the output to bf16 stochastically with a fresh random draw per call: each run is within the
    error bound, but two runs differ bitwise."""

    caught_by = "check_deterministic"
    diagnosed_as = "nondeterministic_reduction"

    def epilogue(self, acc, layer):
        out = self.scaled(acc, layer)
        bits = out.contiguous().view(torch.int32)
        noise = torch.randint(0, 1 << 16, bits.shape, dtype=torch.int32)  # unseeded on purpose
        rounded = ((bits + noise) & ~0xFFFF).view(torch.float32)
        return torch.where(torch.isfinite(out), rounded, out).bfloat16()


class FirstShardScaleInsteadOfMax(PlainDense):
    """Uses ``weight_scale_2[0]`` of a fused layer instead of the max over shards."""

    caught_by = "check_within_error_bound"
    diagnosed_as = "first_shard_scale"

    def alpha(self, layer):
        return layer.weight_scale_2.float().reshape(-1)[0]


class TransposedWeight(PlainDense):
    """Reads the ``[N, K]`` weight as if it were stored ``[K, N]`` (a transposed-layout bug)."""

    caught_by = "check_within_error_bound"
    diagnosed_as = "transposed_weight"

    def decode_weight(self, layer):
        w = super().decode_weight(layer)
        return w.reshape(w.shape[1], w.shape[0]).T


class NonFiniteScrubbed(PlainDense):
    """Replaces NaN/Inf in the output by finite numbers (``nan_to_num``), hiding bad activations."""

    caught_by = "check_nonfinite_policy"
    diagnosed_as = "nonfinite_scrubbed"

    def epilogue(self, acc, layer):
        return torch.nan_to_num(super().epilogue(acc, layer), nan=0.0, posinf=0.0, neginf=0.0)


class E4M3SubnormalsFlushed(PlainDense):
    """Flushes E4M3 subnormal block scales to zero (an FTZ decode)."""

    caught_by = "check_within_error_bound"
    diagnosed_as = "e4m3_subnormals_flushed"

    def decode_weight(self, layer):
        raw = layer.weight_scale.view(torch.uint8)
        subnormal = (raw & 0x78) == 0
        flushed = torch.where(subnormal, raw & 0x80, raw).view(torch.float8_e4m3fn)
        return super().decode_weight(with_(layer, weight_scale=flushed))


class Fp16Activations(PlainDense):
    """Converts the BF16 activations to FP16 before the GEMM (an FP16 kernel reused for W4A16): exact inside
    [2^-14, 65504], inf beyond, bits lost or flushed below."""

    caught_by = "check_within_error_bound"
    diagnosed_as = ("fp16_activations", "fp16_range_only")

    def prescale(self, x, layer):
        return super().prescale(x.half(), layer)


class Bf16SplitKPartials(PlainDense):
    """Split-K with the partial sums stored in BF16 (the workspace in the output dtype): one extra rounding of
    each partial before the final sum. Within the error bound; not a single rounding."""

    caught_by = "check_correctly_rounded"
    diagnosed_as = "bf16_partial_sums"

    def gemm(self, x, w):
        half = x.shape[1] // 2
        return (x[:, :half] @ w[:, :half].T).bfloat16().float() + (x[:, half:] @ w[:, half:].T).bfloat16().float()


class TruncatingOutputConversion(PlainDense):
    """Converts the fp32 result to BF16 by dropping the low 16 bits (round toward zero) instead of rounding to
    nearest. Within the error bound; biased toward zero."""

    caught_by = "check_rounding_direction"
    diagnosed_as = "truncating_conversion"

    def epilogue(self, acc, layer):
        return _truncate_to_bf16(self.scaled(acc, layer))


class Bf16StreamKAtomics(PlainDense):
    """Stream-K as humming 0.1.19 does it on SM90 (``epilogue/gmem_writer.cuh``): K is cut into ``SLICES``
    contiguous slices, each slice's alpha-scaled partial is rounded to BF16, and the slices are added into the
    BF16 output in the order the CTAs finish (``atomic_reduce_add_f162``). Here the order rotates from call to
    call (not random, so the self-test cannot be flaky)."""

    caught_by = "check_deterministic"
    diagnosed_as = ("bf16_partial_sums_unordered", "same_sign_only")
    SLICES = 4
    _calls = 0

    def gemm(self, x, w):
        return x, w  # the epilogue does the sliced GEMM

    def epilogue(self, acc, layer):
        x, w = acc
        bounds = torch.linspace(0, x.shape[1], self.SLICES + 1).round().long().tolist()
        parts = []
        for s, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
            p = (x[:, lo:hi] @ w[:, lo:hi].T) * self.alpha(layer)
            if s == 0 and layer.bias is not None:
                p = p + layer.bias.float()
            parts.append(p.bfloat16())
        self._calls += 1
        order = [(i + self._calls) % self.SLICES for i in range(self.SLICES)]
        out = parts[order[0]]
        for i in order[1:]:
            out = (out.float() + parts[i].float()).bfloat16()
        return out


class BiasIgnored(PlainDense):
    """Never adds the bias (the layer has one; the kernel was called with ``bias=None``)."""

    caught_by = "check_within_error_bound"
    diagnosed_as = ("bias_dropped", "bias_only")

    def epilogue(self, acc, layer):
        return super().epilogue(acc, with_(layer, bias=None))


class OneShardDecodedWithOwnScale(PlainDense):
    """Fused q/k/v where one shard (the first whose ``weight_scale_2`` is not the max) was dequantized with its
    own ``weight_scale_2`` before the fusion, the others with the layer's max: only that shard is off."""

    caught_by = "check_within_error_bound"
    diagnosed_as = "one_shard_wrong"

    def decode_weight(self, layer):
        w = super().decode_weight(layer)
        ws2 = layer.weight_scale_2.float().reshape(-1)
        below = [i for i in range(ws2.numel()) if ws2[i] < ws2.max()]
        if below:
            lo = sum(layer.shard_sizes[: below[0]])
            w[lo:lo + layer.shard_sizes[below[0]]] *= ws2[below[0]] / ws2.max()
        return w


class KTailDropped(PlainDense):
    """Runs whole 64-element K blocks only: the ``K % 64`` tail is never accumulated (K = 48: nothing is)."""

    caught_by = "check_within_error_bound"
    diagnosed_as = "k_tail"  # a cross-case pattern: no single run shows where

    def gemm(self, x, w):
        k = (x.shape[1] // 64) * 64
        return x[:, :k] @ w[:, :k].T


class LargeMKernelScaleShifted(PlainDense):
    """Dispatches M > 64 to a second kernel whose block-scale index is off by one (the small-M kernel is right)."""

    caught_by = "check_within_error_bound"
    diagnosed_as = "m_size"  # cross-case; each failing run also shows block_scale_shifted

    def run_dense(self, prepared, x):
        self._large = x.numel() // x.shape[-1] > 64
        return super().run_dense(prepared, x)

    def decode_weight(self, layer):
        if getattr(self, "_large", False):
            shifted = torch.roll(layer.weight_scale.view(torch.uint8), 1, 1).view(torch.float8_e4m3fn)
            layer = with_(layer, weight_scale=shifted)
        return super().decode_weight(layer)


def _truncate_to_bf16(v: torch.Tensor) -> torch.Tensor:
    bits = v.contiguous().view(torch.int32) & ~0xFFFF
    return torch.where(torch.isfinite(v), bits.view(torch.float32), v).bfloat16()


MUTANTS: tuple[type[PlainDense], ...] = (
    Bf16StreamKAtomics,
    KTailDropped,
    LargeMKernelScaleShifted,
    BiasIgnored,
    OneShardDecodedWithOwnScale,
    NibbleSwapped,
    UnswizzledScalesReadAsSwizzled,
    W4A4AlphaUnderW4A16,
    GlobalScaleDropped,
    GlobalScaleDoubled,
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


# ----------------------------------------------------------------------------------------- pattern probes
#: Cheap cpu cases without the features the cross-case patterns look for.
_PLAIN_PROBES = ("cpu-m7-n160-k256", "cpu-n256-k128-m8", "cpu-square-n128-k128", "cpu-pow2-alpha-m1-n2048-k256",
                 "cpu-m1-n160-k256")
#: M from 7 to 128 (the m_size pattern needs failing cases above every passing one).
_M_PROBES = ("cpu-m7-n160-k256", "cpu-m16-n160-k256", "cpu-m33-n160-k256", "cpu-pow2-alpha-nonneg-m64-n128-k1024",
             "cpu-pow2-alpha-3d-noncontiguous", "cpu-m128-n160-k256")
#: The only other same-sign case, run on the CPU (M = 1: cheap): the cpu tier has a single one.
_EXTRA_PROBES = ("cuda-pow2-alpha-nonneg-m1-n14336-k4096",)


def pattern_probe_cases(name: str) -> list:
    """Cases on which a backend showing cross-case pattern ``name`` (conformance.dense.diagnosis.PATTERNS) is
    judged in the self-tests: up to 4 cases with its feature and 3 without (a report judges all cases)."""
    import dataclasses

    from conformance.dense.cases import DENSE_CASES
    from conformance.dense.diagnosis import PATTERNS, case_features

    by_id = {c.id: c for c in DENSE_CASES}
    pattern = next(p for p in PATTERNS if p.name == name)
    if pattern.dimension is not None:
        return [by_id[i] for i in _M_PROBES]
    pool = [c for c in DENSE_CASES if c.tier == "cpu"] + [dataclasses.replace(by_id[i], tier="cpu") for i in _EXTRA_PROBES]
    having = [c for c in pool if pattern.feature in case_features(c)][:4]
    lacking = [by_id[i] for i in _PLAIN_PROBES if pattern.feature not in case_features(by_id[i])][:3]
    return having + lacking

