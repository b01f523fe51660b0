"""W4A16 dense cases as data, and the deterministic inputs each case stands for.

The case type and its builders (:class:`DenseCase`, :func:`build_layer`, :func:`build_activations`) are shared
with other areas and live in :mod:`conformance._framework.dense_layers`; re-exported here.
"""
from __future__ import annotations

from conformance._framework.dense_layers import (  # noqa: F401 - re-exported: the dense area's case vocabulary
    BF16_RANGE_X_KINDS,
    DENSE_BOUND,
    DenseCase,
    LLM_SHAPES,
    MIXED_ROW_EXPONENTS,
    NONFINITE_PATTERN,
    WeightKind,
    XKind,
    build_activations,
    build_layer,
)

#: Every single-rounding check (conformance.dense.checks.STRICT_CHECKS).
ALL_STRICT = ("check_correctly_rounded", "check_rounding_direction", "check_ulp_error_spread")


def _cpu_cases() -> list[DenseCase]:
    cases = [DenseCase(f"cpu-m{m}-n160-k256", "cpu", (m,), 160, 256) for m in (1, 2, 3, 7, 16, 33, 128, 1000)]
    cases += [
        DenseCase("cpu-n256-k128-m8", "cpu", (8,), 256, 128),
        DenseCase("cpu-n200-not-mult-128", "cpu", (9,), 200, 128),
        DenseCase("cpu-k80-mult16-not64", "cpu", (5,), 96, 80),
        DenseCase("cpu-k48-mult16-not64", "cpu", (3,), 64, 48),
        DenseCase("cpu-square-n128-k128", "cpu", (4,), 128, 128),
        DenseCase("cpu-square-n192-k192", "cpu", (3,), 192, 192),
        DenseCase("cpu-3d-2x5", "cpu", (2, 5), 160, 128),
        DenseCase("cpu-3d-3x1x7", "cpu", (3, 1, 7), 96, 64),
        DenseCase("cpu-noncontiguous", "cpu", (7,), 160, 128, x_kind="noncontiguous"),
        DenseCase("cpu-noncontiguous-3d", "cpu", (2, 3), 96, 64, x_kind="noncontiguous"),
        DenseCase("cpu-bias", "cpu", (6,), 160, 128, bias=True),
        DenseCase("cpu-awq", "cpu", (6,), 160, 128, awq=True),
        DenseCase("cpu-awq-bias-3d", "cpu", (2, 3), 192, 192, bias=True, awq=True),
        DenseCase("cpu-fused-qkv-3-scales", "cpu", (5,), 192, 128, shards=((128, 0.25), (32, 1.0), (32, 0.5))),
        DenseCase("cpu-no-input-scale", "cpu", (4,), 96, 64, input_scale=False),
        DenseCase("cpu-zero-blocks", "cpu", (7,), 160, 128, weight_kind="zero_blocks"),
        DenseCase("cpu-e4m3-max-448", "cpu", (7,), 160, 128, weight_kind="e4m3_max"),
        DenseCase("cpu-e4m3-subnormal", "cpu", (7,), 160, 128, weight_kind="e4m3_subnormal"),
        DenseCase("cpu-nonfinite-activations", "cpu", (8,), 160, 128, x_kind="nonfinite"),
        DenseCase("cpu-nonfinite-3d-bias", "cpu", (2, 4), 96, 64, bias=True, x_kind="nonfinite"),
        # Activations that are normal BF16 but not FP16 (W4A16 keeps activations in BF16).
        DenseCase("cpu-x-beyond-fp16", "cpu", (8,), 160, 128, x_kind="beyond_fp16"),
        DenseCase("cpu-x-below-fp16-normal", "cpu", (8,), 160, 128, x_kind="below_fp16_normal"),
        DenseCase("cpu-x-mixed-magnitudes", "cpu", (10,), 160, 128, x_kind="mixed_magnitudes"),
        DenseCase("cpu-x-channel-outliers-awq", "cpu", (6,), 160, 256, awq=True, x_kind="channel_outliers"),
        # Single rounding: BF16-exact weights (power-of-two alpha), so the output's rounding is the contract's only one.
        DenseCase("cpu-pow2-alpha-m128-n160-k256", "cpu", (128,), 160, 256, weight_kind="pow2_alpha",
                  strict_checks=ALL_STRICT),
        DenseCase("cpu-pow2-alpha-m1-n2048-k256", "cpu", (1,), 2048, 256, weight_kind="pow2_alpha",
                  strict_checks=ALL_STRICT),
        DenseCase("cpu-pow2-alpha-nonneg-m64-n128-k1024", "cpu", (64,), 128, 1024, weight_kind="pow2_alpha_nonneg",
                  x_kind="nonneg", strict_checks=ALL_STRICT),
        DenseCase("cpu-pow2-alpha-3d-noncontiguous", "cpu", (2, 33), 160, 128, weight_kind="pow2_alpha",
                  x_kind="noncontiguous", strict_checks=ALL_STRICT),
        DenseCase("cpu-pow2-alpha-x-beyond-fp16", "cpu", (16,), 256, 128, weight_kind="pow2_alpha",
                  x_kind="beyond_fp16", strict_checks=ALL_STRICT),
        DenseCase("cpu-pow2-alpha-x-mixed-magnitudes", "cpu", (40,), 256, 128, weight_kind="pow2_alpha",
                  x_kind="mixed_magnitudes", strict_checks=ALL_STRICT),
        # alpha = 1.5 * 2^e: the alpha multiply rounds, so rounding acc to BF16 before it is a second rounding.
        DenseCase("cpu-alpha-1p5-pow2-m128-n160-k256", "cpu", (128,), 160, 256, weight_kind="three_pow2_alpha",
                  strict_checks=ALL_STRICT),
    ]
    return cases


def _cuda_cases() -> list[DenseCase]:
    cases = [DenseCase("cuda-m4096-n160-k256", "cuda", (4096,), 160, 256)]
    for n, k in LLM_SHAPES:
        for m in (1, 4096):
            cases.append(DenseCase(f"cuda-llm-n{n}-k{k}-m{m}", "cuda", (m,), n, k))
    cases += [
        DenseCase("cuda-llm-qkv-3-scales-m33", "cuda", (33,), 6144, 4096, shards=((4096, 0.25), (1024, 1.0), (1024, 0.5))),
        DenseCase("cuda-llm-awq-bias-3d", "cuda", (4, 257), 4096, 4096, bias=True, awq=True),
        DenseCase("cuda-n200-k80-m7", "cuda", (7,), 200, 80),
        DenseCase("cuda-square-noncontiguous", "cuda", (129,), 4096, 4096, x_kind="noncontiguous"),
        DenseCase("cuda-nonfinite-activations", "cuda", (16,), 4096, 4096, x_kind="nonfinite"),
        DenseCase("cuda-e4m3-max-448", "cuda", (64,), 4096, 4096, weight_kind="e4m3_max"),
        DenseCase("cuda-e4m3-subnormal", "cuda", (64,), 4096, 4096, weight_kind="e4m3_subnormal"),
        DenseCase("cuda-zero-blocks", "cuda", (64,), 4096, 4096, weight_kind="zero_blocks"),
        DenseCase("cuda-x-beyond-fp16", "cuda", (64,), 4096, 4096, x_kind="beyond_fp16"),
        DenseCase("cuda-x-below-fp16-normal", "cuda", (64,), 4096, 4096, x_kind="below_fp16_normal"),
        DenseCase("cuda-x-mixed-magnitudes", "cuda", (65,), 4096, 4096, x_kind="mixed_magnitudes"),
        DenseCase("cuda-x-channel-outliers-awq", "cuda", (64,), 4096, 4096, awq=True, x_kind="channel_outliers"),
        # Single rounding at kernel sizes. Non-negative inputs keep the worst-case fp32 allowance below 1/8 ulp up
        # to K = 4096; at K = 14336 only the (deterministic) correct-rounding check has decidable elements.
        DenseCase("cuda-pow2-alpha-m4096-n4096-k256", "cuda", (4096,), 4096, 256, weight_kind="pow2_alpha",
                  strict_checks=ALL_STRICT),
        DenseCase("cuda-pow2-alpha-nonneg-m256-n4096-k4096", "cuda", (256,), 4096, 4096,
                  weight_kind="pow2_alpha_nonneg", x_kind="nonneg", strict_checks=ALL_STRICT),
        DenseCase("cuda-pow2-alpha-nonneg-m1-n14336-k4096", "cuda", (1,), 14336, 4096,
                  weight_kind="pow2_alpha_nonneg", x_kind="nonneg", strict_checks=ALL_STRICT),
        DenseCase("cuda-pow2-alpha-nonneg-m64-n4096-k14336", "cuda", (64,), 4096, 14336,
                  weight_kind="pow2_alpha_nonneg", x_kind="nonneg", strict_checks=("check_correctly_rounded",)),
        DenseCase("cuda-pow2-alpha-x-mixed-magnitudes", "cuda", (65,), 4096, 256, weight_kind="pow2_alpha",
                  x_kind="mixed_magnitudes", strict_checks=ALL_STRICT),
        DenseCase("cuda-alpha-1p5-pow2-m4096-n4096-k256", "cuda", (4096,), 4096, 256, weight_kind="three_pow2_alpha",
                  strict_checks=ALL_STRICT),
    ]
    return cases


DENSE_CASES: tuple[DenseCase, ...] = tuple(_cpu_cases() + _cuda_cases())
CPU_CASES: tuple[DenseCase, ...] = tuple(c for c in DENSE_CASES if c.tier == "cpu")
NONFINITE_CASES: tuple[DenseCase, ...] = tuple(c for c in DENSE_CASES if c.x_kind == "nonfinite")
SINGLE_ROUNDING_CASES: tuple[DenseCase, ...] = tuple(c for c in DENSE_CASES if c.strict_checks)
