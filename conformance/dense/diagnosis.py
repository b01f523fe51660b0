"""Dense W4A16 diagnosis rules: what a pattern of failing checks looks like to a kernel author.

Per run (:data:`RULES`, matched by :func:`diagnose_run`), on the checks of :data:`conformance.dense.checks.NAMED_CHECKS`
and facts computed only when a check fails:

* rounding patterns from the strict single-rounding checks and the determinism check (an extra BF16 rounding of
  partial sums, in run-dependent order or not; a truncating conversion);
* *readings*: when the bound is exceeded, the output is compared with the exact value of the checkpoint read
  the way a classic bug reads it (nibbles swapped, linear scales indexed as 128x4-swizzled, scales shifted by
  one block, the W4A4 alpha, one shard's or every shard's own ``weight_scale_2``, a transposed weight, AWQ
  ``pre_quant_scale`` dropped, the bias twice or not at all, E4M3-subnormal scales flushed). A reading
  *matches* when every element is within the derived bound of that alternative's exact value -- the same
  evidence standard as the check itself;
* *where* it is wrong: only rows from some M on, only output features from some N on, only one fused shard,
  only rows whose activations lie outside FP16's range.

Across cases (:data:`PATTERNS`, :func:`diagnose_dense_cases`): a check failing only where ``K % 64 != 0`` or
``N % 128 != 0``, only for ``M`` above some size, only on same-sign data, only with a bias / AWQ / strided
activations / activations outside FP16's range. Every rule and pattern has a mutant that shows it
(``tests/dense/mutants.py``, ``diagnosed_as``; red-team backends in ``tests/dense/test_dense_redteam.py``).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

import torch

from reference_impl.dense import w4a16_linear_exact
from reference_impl.format.nvfp4 import swizzle_offsets, swizzled_shape

from conformance._framework.diagnosis import (CaseOutcome, Diagnosis, Evidence, Pattern, Rule, diagnose, diagnose_cases,
                                              appending_diagnoses)
from conformance.dense.checks import NAMED_CHECKS, STRICT_CHECKS, DenseRun, exact_and_bound, failing_checks_of_run
from conformance.interfaces.kernel import Backend
from reference_impl.bounds.dense import dense_error_bound
from conformance.interfaces.kernel import DenseLayer

AREA = "dense"
BOUND = "check_within_error_bound"
FP16_MAX, FP16_MIN_NORMAL = 65504.0, 2.0**-14


def _r(name: str, explanation: str, **kw) -> Rule:
    return Rule.of(name, AREA, explanation, **kw)


def _reading(name: str, explanation: str) -> Rule:
    return _r(name, f"the output matches the checkpoint read {explanation}", fails=[BOUND], facts=[f"reads:{name}"])


RULES: tuple[Rule, ...] = (
    _r("bf16_partial_sums_unordered",
       "not deterministic and more than one rounding: partial sums rounded to BF16 and added in a run-dependent "
       "order -- split-K / stream-K slices reduced into the BF16 output with atomics. The bound is exceeded, if "
       "at all, on same-sign data: nothing cancels there, so each slice's rounding is of the size of |y| "
       "(or: stochastic rounding)",
       fails=["check_deterministic"], fails_any=["check_correctly_rounded", "check_ulp_error_spread", BOUND]),
    _r("bf16_partial_sums",
       "one round-to-nearest too many after the exact products: partial sums kept in BF16 (split-K / stream-K "
       "with an ordered reduction, a BF16 workspace), or the fp32 sum rounded to BF16 before the alpha multiply "
       "(then only the alpha = 1.5 * 2^e case fails)",
       fails_any=["check_correctly_rounded", "check_ulp_error_spread"],
       passes=["check_deterministic", "check_rounding_direction"]),
    _r("truncating_conversion",
       "the FP32 -> BF16 output conversion rounds toward zero (drops the low 16 bits) instead of to nearest",
       fails=["check_rounding_direction"]),
    _r("nondeterministic_reduction",
       "run-to-run differences within the bound: a reduction whose order changes between runs (atomics in "
       "split-K / stream-K, a persistent kernel's tile order), or stochastic rounding",
       fails=["check_deterministic"], passes=[BOUND]),
    _reading("nibble_swapped", "with the two E2M1 codes of each byte swapped (element 2i is the LOW nibble)"),
    _reading("scales_read_as_swizzled",
             "with its linear block scales indexed through the 128x4 swizzle: the scales were not swizzled for a "
             "kernel that expects them swizzled (or swizzled with the wrong layout)"),
    _reading("block_scale_shifted", "with block k's scale applied to block k+1 (off-by-one in the scale index)"),
    _reading("w4a4_alpha", "with alpha = input_scale * weight_scale_2: the W4A4 alpha, although W4A16 never "
             "quantizes the activations (input_scale must be ignored)"),
    _reading("global_scale_missing", "without its per-tensor FP32 decode scale: weight_scale_2 never applied "
             "(alpha = 1; the output is the exact one divided by weight_scale_2, cosine ~1, a constant ratio)"),
    _reading("global_scale_doubled", "with its per-tensor FP32 decode scale applied twice (alpha = weight_scale_2^2: "
             "folded into the weights and again in the epilogue)"),
    _reading("first_shard_scale", "with weight_scale_2[0] as alpha for every fused shard (not the max)"),
    _reading("min_shard_scale", "with the min of the fused shards' weight_scale_2 as alpha (not the max)"),
    _reading("per_shard_scale", "with each fused shard decoded by its own weight_scale_2: per-shard scales, "
             "where engines fold one alpha = max(weight_scale_2) per layer"),
    _reading("transposed_weight", "as [K, N] instead of [N, K] (a transposed weight layout)"),
    _reading("pre_quant_scale_dropped", "without its AWQ pre_quant_scale (x * pre_quant_scale not applied)"),
    _reading("pre_quant_scale_inverted", "with its activations divided by the AWQ pre_quant_scale instead of "
             "multiplied (the scale's convention inverted)"),
    _reading("bias_twice", "with the bias added twice (in the kernel epilogue and again in the layer)"),
    _reading("bias_dropped", "without its bias"),
    _reading("e4m3_subnormals_flushed", "with E4M3-subnormal block scales flushed to zero (an FTZ scale decode)"),
    _r("m_tail", "rows {rows_wrong_from} and up are wrong, the rows before are right: the last partial M tile "
       "(M tail handling past a multiple of the kernel's M block)", fails=[BOUND], facts=["rows_wrong_from"]),
    _r("n_tail", "output features {cols_wrong_from} and up are wrong, the ones before are right: the last partial N "
       "tile (N tail handling past a multiple of the kernel's N block)", fails=[BOUND], facts=["cols_wrong_from"]),
    _r("one_shard_wrong", "only fused shard {shard_wrong} is wrong: a per-shard decode scale or a shard offset",
       fails=[BOUND], facts=["shard_wrong"]),
    _r("fp16_activations", "only rows whose activations lie outside FP16's normal range [2^-14, 65504] are wrong: "
       "the BF16 activations went through FP16 (overflow to Inf, loss below 2^-14)",
       fails=[BOUND], facts=["wrong_rows_outside_fp16"]),
    _r("nonfinite_scrubbed", "NaN/Inf from the activations do not reach the output: replaced by finite values "
       "(nan_to_num, a clamp, or a saturating FP16/FP8 conversion)", fails=["check_nonfinite_policy"]),
)

PATTERNS: tuple[Pattern, ...] = (
    Pattern("k_tail", AREA, "{check} fails only on cases with K % 64 != 0 ({failing} of them; {passing} cases "
            "pass): the K tail past the last multiple of 64 (a partial K block or a partial group of 4 block "
            "scales) is mishandled", feature="k_not_multiple_of_64"),
    Pattern("n_tail_cases", AREA, "{check} fails only on cases with N % 128 != 0 ({failing}): the last partial "
            "N tile", feature="n_not_multiple_of_128"),
    Pattern("m_size", AREA, "{check} fails only for M >= {threshold} (right up to M = {largest_passing}): the "
            "kernel or tile configuration chosen for large M", dimension="m"),
    Pattern("same_sign_only", AREA, "{check} fails only on same-sign data ({failing} cases): no cancellation, "
            "so every intermediate is as large as the result -- extra roundings of partial sums show there",
            feature="x_nonneg"),
    Pattern("bias_only", AREA, "{check} fails only on layers with a bias: the bias epilogue", feature="bias"),
    Pattern("awq_only", AREA, "{check} fails only with AWQ pre_quant_scale: the activation pre-scale",
            feature="awq"),
    Pattern("noncontiguous_only", AREA, "{check} fails only on non-contiguous activations: strides ignored",
            feature="noncontiguous"),
    Pattern("fp16_range_only", AREA, "{check} fails only on activations outside FP16's range: BF16 activations "
            "converted to FP16", feature="x_outside_fp16"),
)


def case_features(case) -> frozenset[str]:
    """The case's features plus the shape features the patterns use."""
    f = set(case.features)
    f |= {"k_not_multiple_of_64"} if case.k % 64 else set()
    f |= {"n_not_multiple_of_128"} if case.n % 128 else set()
    f |= {"x_outside_fp16"} if case.x_kind in ("beyond_fp16", "below_fp16_normal", "mixed_magnitudes",
                                                             "channel_outliers") else set()
    return frozenset(f)


def case_shape(case) -> dict[str, int]:
    return {"m": case.m, "n": case.n, "k": case.k}


# ------------------------------------------------------------------------------------------ facts
def _within(y: torch.Tensor, exact: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """Elementwise: finite exact values within the bound (non-finite ones: y non-finite too)."""
    yd = y.double()
    return torch.where(torch.isfinite(exact), (yd - exact).abs() <= bound, ~torch.isfinite(yd))


def _exact_bound(run, layer: DenseLayer, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    exact, magnitude = w4a16_linear_exact(x, layer.weight, layer.weight_scale, layer.weight_scale_2,
                                          layer.pre_quant_scale, layer.bias)
    return exact, dense_error_bound(exact, magnitude, run.case.k, has_pre_quant_scale=layer.pre_quant_scale is not None,
                                    bias=layer.bias)


def _scales_read_as_swizzled(scale: torch.Tensor) -> torch.Tensor:
    n, n_sf = scale.shape
    rows, cols = swizzled_shape(n, n_sf)
    buffer = torch.zeros(rows * cols, dtype=torch.uint8, device=scale.device)
    buffer[: n * n_sf] = scale.view(torch.uint8).reshape(-1)
    return buffer[swizzle_offsets(n, n_sf, scale.device)].view(torch.float8_e4m3fn)


def _readings(layer: DenseLayer) -> dict[str, Callable[[], list[DenseLayer]]]:
    """name -> the layer(s) (one per fused shard for per-shard scales) the reading computes with; only the
    readings that differ from the contract for this layer."""
    ws2 = layer.weight_scale_2.float().reshape(-1)
    raw = layer.weight_scale.view(torch.uint8)
    out: dict[str, Callable[[], list[DenseLayer]]] = {
        "nibble_swapped": lambda: [replace(layer, weight=(layer.weight >> 4) | (layer.weight << 4))],
        "scales_read_as_swizzled": lambda: [replace(layer, weight_scale=_scales_read_as_swizzled(layer.weight_scale))],
        "block_scale_shifted": lambda: [replace(layer, weight_scale=torch.roll(raw, 1, 1).view(torch.float8_e4m3fn))],
    }
    alpha = ws2.max()
    if bool(alpha != 1.0):  # else leaving it out or applying it twice changes nothing
        out["global_scale_missing"] = lambda: [replace(layer, weight_scale_2=torch.ones(1, dtype=torch.float32,
                                                                                        device=ws2.device))]
        out["global_scale_doubled"] = lambda: [replace(layer, weight_scale_2=(alpha * alpha).reshape(1))]
    if layer.input_scale is not None:
        out["w4a4_alpha"] = lambda: [replace(layer, weight_scale_2=ws2 * layer.input_scale.float().max())]
    if ws2.numel() > 1 and bool((ws2 != ws2.max()).any()):
        out["first_shard_scale"] = lambda: [replace(layer, weight_scale_2=ws2[:1])]
        out["min_shard_scale"] = lambda: [replace(layer, weight_scale_2=ws2.min().reshape(1))]
        out["per_shard_scale"] = lambda: _shards(layer)
    if layer.pre_quant_scale is not None:
        out["pre_quant_scale_dropped"] = lambda: [replace(layer, pre_quant_scale=None)]
        out["pre_quant_scale_inverted"] = lambda: [replace(layer, pre_quant_scale=1.0 / layer.pre_quant_scale.double())]
    if layer.bias is not None:
        out["bias_twice"] = lambda: [replace(layer, bias=layer.bias * 2)]
        out["bias_dropped"] = lambda: [replace(layer, bias=None)]
    if bool(((raw & 0x78) == 0).logical_and(raw & 0x07 != 0).any()):
        flushed = torch.where((raw & 0x78) == 0, raw & 0x80, raw).view(torch.float8_e4m3fn)
        out["e4m3_subnormals_flushed"] = lambda: [replace(layer, weight_scale=flushed)]
    return out


def _shards(layer: DenseLayer) -> list[DenseLayer]:
    parts, start = [], 0
    for i, rows in enumerate(layer.shard_sizes):
        sl = slice(start, start + rows)
        parts.append(DenseLayer(layer.weight[sl], layer.weight_scale[sl], layer.weight_scale_2.reshape(-1)[i:i + 1],
                                (rows,), None, layer.pre_quant_scale, None if layer.bias is None else layer.bias[sl]))
        start += rows
    return parts


def _reading_matches(run, layers: list[DenseLayer], y: torch.Tensor) -> bool:
    pieces = [_exact_bound(run, lay, run.x) for lay in layers]
    exact = torch.cat([p[0] for p in pieces], dim=-1)
    bound = torch.cat([p[1] for p in pieces], dim=-1)
    return bool(_within(y, exact, bound).all())


def _transposed_matches(run, y: torch.Tensor) -> bool:
    from reference_impl.format.nvfp4 import codes_times_block_scales

    layer = run.layer
    w = codes_times_block_scales(layer.weight, layer.weight_scale).double()
    w = w.reshape(w.shape[1], w.shape[0]).T  # the [N, K] bytes read as [K, N]
    alpha = layer.weight_scale_2.double().max()
    x = run.x.double().reshape(-1, run.case.k)
    if layer.pre_quant_scale is not None:
        x = x * layer.pre_quant_scale.double()
    exact, magnitude = (x @ w.T) * alpha, (x.abs() @ w.abs().T) * alpha
    if layer.bias is not None:
        exact = exact + layer.bias.double()
    bound = dense_error_bound(exact, magnitude, run.case.k, has_pre_quant_scale=layer.pre_quant_scale is not None,
                              bias=layer.bias)
    return bool(_within(y.reshape(exact.shape), exact, bound).all())


def _tail_start(bad: torch.Tensor) -> int:
    """The first bad index when every index from it on is bad and every one before is good (else 0)."""
    if not bool(bad.any()):
        return 0
    first = int(bad.nonzero()[0])
    return first if first > 0 and bool(bad[first:].all()) else 0


def run_facts(run, failing: Iterable[str]) -> dict[str, Any]:
    """Facts about a failing run (module docstring); empty unless the error bound failed."""
    failing = set(failing)
    y = run.y
    if BOUND not in failing or not isinstance(y, torch.Tensor) or y.dtype != torch.bfloat16 \
            or tuple(y.shape) != (*run.x.shape[:-1], run.case.n):
        return {}
    facts: dict[str, Any] = {}
    for name, layers in _readings(run.layer).items():
        facts[f"reads:{name}"] = _reading_matches(run, layers(), y)
    if run.case.n == run.case.k:
        facts["reads:transposed_weight"] = _transposed_matches(run, y)
    exact, bound = exact_and_bound(run)
    bad = ~_within(y, exact, bound).reshape(-1, run.case.n)
    bad_rows, bad_cols = bad.any(1), bad.any(0)
    facts["rows_wrong_from"] = _tail_start(bad_rows)
    facts["cols_wrong_from"] = _tail_start(bad_cols)
    sizes = run.layer.shard_sizes
    if len(sizes) > 1:
        bounds = torch.tensor([0, *sizes]).cumsum(0).tolist()
        wrong = [i for i in range(len(sizes)) if bool(bad_cols[bounds[i]:bounds[i + 1]].any())]
        if len(wrong) == 1:
            facts["shard_wrong"] = f"{wrong[0]} (output features {bounds[wrong[0]]}..{bounds[wrong[0] + 1] - 1})"
    xa = run.x.reshape(-1, run.case.k).double().abs()
    outside = ((xa > FP16_MAX) | ((xa > 0) & (xa < FP16_MIN_NORMAL))).any(1)
    # only rows outside FP16's range are wrong, and some rows inside it exist (and are right): with every row
    # outside, any bug would look like this
    facts["wrong_rows_outside_fp16"] = (bool(bad_rows.any()) and not bool((bad_rows & ~outside).any())
                                        and bool((~outside).any()))
    return facts


def evidence(run, failing: Iterable[str]) -> Evidence:
    failing = frozenset(failing)
    # evaluated on this case: the strict checks only where the case lists them, the policy only on NaN/Inf data
    evaluated = {n for n in NAMED_CHECKS if n not in STRICT_CHECKS or n in run.case.strict_checks}
    if run.case.x_kind != "nonfinite":
        evaluated.discard("check_nonfinite_policy")
    return Evidence(AREA, failing, frozenset(evaluated) - failing, case_features(run.case), case_shape(run.case),
                    run_facts(run, failing))


#: rules whose evidence a matching reading explains: when the output is the checkpoint read another way (every
#: element within the bound of that reading), the strict rounding checks and the wrong rows or columns fail
#: because of it, so these would name causes their own evidence does not support
SUBSUMED_BY_A_READING = frozenset({"bf16_partial_sums", "truncating_conversion", "m_tail", "n_tail",
                                   "one_shard_wrong", "fp16_activations"})
READINGS = frozenset(r.name for r in RULES if any(f.startswith("reads:") for f in r.facts)) | {"transposed_weight"}


def diagnose_run(run, failing: Iterable[str]) -> list[Diagnosis]:
    """The per-run rules that match ``run`` given the names of its failing checks, ranked by how much of the
    error each explains: a reading (the whole output is the checkpoint read another way) first, and then no rule
    whose evidence that reading already explains; then the rest, most specific first."""
    hits = diagnose(RULES, evidence(run, failing))
    readings = [d for d in hits if d.rule in READINGS]
    if not readings:
        return hits
    return readings + [d for d in hits if d.rule not in READINGS and d.rule not in SUBSUMED_BY_A_READING]


def diagnose_dense_cases(results: Iterable[tuple[Any, Iterable[str]]]) -> list[Diagnosis]:
    """The cross-case patterns of one backend's ``(case, failing check names)`` results."""
    outcomes = [CaseOutcome(c.id, frozenset(f), case_features(c), case_shape(c)) for c, f in results]
    return diagnose_cases(PATTERNS, outcomes, AREA)


def diagnosed(run: DenseRun, backend: Backend, record: Callable[[str, str], None] | None = None):
    """:func:`conformance._framework.diagnosis.appending_diagnoses` with every named dense check evaluated on
    ``run`` and this module's rules matched."""
    return appending_diagnoses(lambda: diagnose_run(run, failing_checks_of_run(run, backend)), record)
