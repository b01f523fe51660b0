"""The dense W4A16 checks: plain functions that raise ``AssertionError`` with a readable report.

Each is registered once (``@check("dense", ...)``, :mod:`conformance._framework.checks`): the conformance tests
(``conformance/dense/test_dense.py``) run the checks registered for them on the backend under test; the
self-tests (``tests/dense/test_dense_mutants.py``) run them all on deliberately broken backends to prove each can fail,
each mutant naming the check that must catch it.

Non-finite policy (stated once, checked by :func:`check_nonfinite_policy`): activations are not quantized
under W4A16, so NaN/Inf propagate as in IEEE arithmetic. Every output whose exact value (fp64 evaluation
of the same formula) is non-finite must be non-finite (NaN or +-Inf; which one is not checked, as GEMM
hardware may turn ``Inf - Inf`` or ``Inf * 0`` into either); every row whose activations are all finite
is unaffected and judged by the error bound like any other row.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from reference_impl.dense import dense_alpha, w4a16_linear_exact
from reference_impl.format.nvfp4 import E2M1_MAGNITUDES

from conformance.interfaces.kernel import Backend, DenseLayer
from conformance._framework.checks import check, register_area, view
from conformance._framework.checks import failing_checks as _failing
from reference_impl.bounds.dense import (
    FLASHINFER_MAX_REL_L2,
    FLASHINFER_MIN_COSINE,
    U_BF16,
    ErrorFigures,
    dense_error_bound,
    error_figures,
)
from conformance.dense.single_rounding import (
    MIN_DECIDABLE_ELEMENTS,
    MIN_STATISTIC_ELEMENTS,
    RoundingFigures,
    bf16_ulp,
    is_bf16_exact,
    round_to_bf16_exact,
    rounding_figures,
)
from conformance.dense.cases import DenseCase, build_activations, build_layer

DETERMINISM_REPEATS = 3
register_area("dense", "test_dense_matches_reference")


@dataclass(frozen=True)
class DenseRun:
    """One case run through one backend: the inputs it was given and what it returned."""

    case: DenseCase
    layer: DenseLayer
    x: torch.Tensor
    y: Any
    prepared: Any


def run_dense_case(backend: Backend, case: DenseCase) -> DenseRun:
    """Build the case's inputs on its device, prepare the layer once and run it once."""
    layer = build_layer(case)
    x = build_activations(case)
    prepared = backend.prepare_dense(layer, case.device)
    y = backend.run_dense(prepared, x)
    return DenseRun(case, layer, x, y, prepared)


def describe_inputs(run: DenseRun) -> str:
    """The case and its inputs, for failure messages (enough to rebuild them: the case is the seed)."""
    layer, x = run.layer, run.x
    parts = [
        f"case {run.case!r}",
        f"x: {tuple(x.shape)} {x.dtype} stride={x.stride()} device={x.device}",
        f"weight {tuple(layer.weight.shape)} uint8, weight_scale {tuple(layer.weight_scale.shape)} e4m3 (linear)",
        f"weight_scale_2 {layer.weight_scale_2.tolist()} (alpha = max), shard_sizes {layer.shard_sizes}",
        f"input_scale {None if layer.input_scale is None else layer.input_scale.tolist()} (W4A4 only: ignored)",
        f"pre_quant_scale {'present' if layer.pre_quant_scale is not None else 'absent'}, "
        f"bias {'present' if layer.bias is not None else 'absent'}",
        f"rebuild: conformance.dense.cases.build_layer/build_activations(case) (seed {run.case.seed})",
    ]
    return "\n  ".join(parts)


def exact_and_bound(run: DenseRun) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact fp64 output ``y*`` and the per-element bound of :func:`reference_impl.bounds.dense.dense_error_bound`
    (computed once per run and kept on it: the inputs of a run never change)."""
    exact, magnitude = _exact_and_magnitude(run)
    cached = run.__dict__.get("_bound")
    if cached is None:
        layer = run.layer
        cached = dense_error_bound(
            exact, magnitude, run.case.k, has_pre_quant_scale=layer.pre_quant_scale is not None, bias=layer.bias
        )
        object.__setattr__(run, "_bound", cached)
    return exact, cached


def _exact_and_magnitude(run: DenseRun) -> tuple[torch.Tensor, torch.Tensor]:
    cached = run.__dict__.get("_exact_and_magnitude")
    if cached is None:
        layer = run.layer
        cached = w4a16_linear_exact(
            run.x, layer.weight, layer.weight_scale, layer.weight_scale_2, layer.pre_quant_scale, layer.bias
        )
        object.__setattr__(run, "_exact_and_magnitude", cached)
    return cached


def dequantized_weights_bf16_exact(layer: DenseLayer) -> bool:
    """Every ``e2m1 * e4m3 * alpha`` the layer can decode to is a BF16 number: checked on the (at most 8 x 256)
    products of the 8 E2M1 magnitudes with the block-scale values present, so it holds for every weight."""
    alpha = float(dense_alpha(layer.weight_scale_2))
    scales = torch.unique(layer.weight_scale.view(torch.uint8)).view(torch.float8_e4m3fn).double().cpu()
    magnitudes = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float64)
    return is_bf16_exact(scales.view(-1, 1) * magnitudes.view(1, -1) * alpha)


def pre_rounding_allowance(run: DenseRun) -> torch.Tensor:
    """``d``: how far a single-rounding implementation's value before its final bf16 rounding may be from ``y*``:
    the bound without its output-rounding term, and without the allowances for rounding the weights (or the
    AWQ-scaled activations) to bf16 where those values are bf16 numbers already, so rounding them is exact
    (:func:`reference_impl.bounds.dense.dense_error_bound`, terms 2-7)."""
    exact, magnitude = _exact_and_magnitude(run)
    layer = run.layer
    prescaled_exact = layer.pre_quant_scale is not None and is_bf16_exact(
        run.x.double() * layer.pre_quant_scale.double()
    )
    bound = dense_error_bound(
        exact, magnitude, run.case.k, has_pre_quant_scale=layer.pre_quant_scale is not None, bias=layer.bias,
        weights_bf16_exact=dequantized_weights_bf16_exact(layer), prescaled_bf16_exact=prescaled_exact,
    )
    return bound - U_BF16 * exact.abs()


@check("dense", test="test_dense_output_dtype_and_shape")
def check_output_dtype_and_shape(run: DenseRun) -> None:
    """The output is a bfloat16 tensor of shape ``[*x.shape[:-1], N]`` on the input's device."""
    y, x, n = run.y, run.x, run.case.n
    assert isinstance(y, torch.Tensor), f"run_dense returned {type(y).__name__}, not a tensor\n  {describe_inputs(run)}"
    expected = (*x.shape[:-1], n)
    assert y.dtype == torch.bfloat16 and tuple(y.shape) == expected and y.device == x.device, (
        f"output is {y.dtype} {tuple(y.shape)} on {y.device}; expected torch.bfloat16 {expected} on {x.device}"
        f"\n  {describe_inputs(run)}"
    )


@check("dense")
def check_within_error_bound(run: DenseRun, record: Callable[[ErrorFigures], None] | None = None) -> ErrorFigures:
    """Every element whose exact value is finite is within the derived bound (``bound_ratio <= 1``).
    Returns the figures (bound ratio, relative L2, cosine) for the report; ``record`` receives them before
    the assertion, so a failing case's report shows how far out it was."""
    check_output_dtype_and_shape(run)
    exact, bound = exact_and_bound(run)
    fig = error_figures(run.y, exact, bound)
    if record is not None:
        record(fig)
    assert fig.bound_ratio <= 1.0, (
        f"W4A16 output outside the derived error bound: max |y - y*| / bound = {fig.bound_ratio:.4g}\n"
        f"  worst element {fig.worst_index}: got {fig.worst_got!r}, exact {fig.worst_exact!r}, "
        f"bound {fig.worst_bound:.4g} (|err| = {abs(fig.worst_got - fig.worst_exact):.4g})\n"
        f"  rel_l2 {fig.rel_l2:.3g}, cosine {fig.cosine:.6f}\n  {describe_inputs(run)}"
    )
    return fig


@check("dense")
def check_summary_figures(run: DenseRun, fig: ErrorFigures | None = None) -> None:
    """The acceptance of FlashInfer's dense W4A16 GEMM test (``tests/gemm/test_mm_bf16_fp4.py``,
    ``_assert_close_to_reference``: relative L2 < 2e-2, cosine > 0.999), looser than the bound: kept so a
    report can say the backend also meets the upstream thresholds (``fig``: the run's figures, if at hand)."""
    fig = fig or check_within_error_bound_figures(run)
    assert fig.rel_l2 < FLASHINFER_MAX_REL_L2 and fig.cosine > FLASHINFER_MIN_COSINE, (
        f"relative L2 {fig.rel_l2:.4g} (limit {FLASHINFER_MAX_REL_L2}) / cosine {fig.cosine:.6f} "
        f"(limit {FLASHINFER_MIN_COSINE})\n  {describe_inputs(run)}"
    )


@check("dense", test="test_dense_nonfinite_policy", applies_to=lambda case: case.x_kind == "nonfinite")
def check_nonfinite_policy(run: DenseRun) -> None:
    """Outputs whose exact value is non-finite are non-finite (see the module docstring)."""
    check_output_dtype_and_shape(run)
    exact, _ = exact_and_bound(run)
    must = ~torch.isfinite(exact)
    assert bool(must.any()), f"case plants no non-finite activation; the policy check would be vacuous: {run.case.id}"
    wrong = must & torch.isfinite(run.y.double())
    if bool(wrong.any()):
        idx = tuple(int(i) for i in wrong.nonzero()[0])
        raise AssertionError(
            f"{int(wrong.sum())} outputs are finite although their exact value is non-finite (NaN/Inf in the "
            f"activations must propagate); first at {idx}: got {float(run.y[idx])!r}, exact {float(exact[idx])!r}"
            f"\n  {describe_inputs(run)}"
        )


@check("dense", test="test_dense_deterministic")
def check_deterministic(run: DenseRun, backend: Backend, repeats: int = DETERMINISM_REPEATS) -> None:
    """``run_dense`` on the same prepared layer and the same input gives bitwise identical outputs."""
    first = run.y
    for i in range(1, repeats):
        again = backend.run_dense(run.prepared, run.x)
        same = again.shape == first.shape and again.dtype == first.dtype
        if same:  # compare bit patterns, so NaNs compare equal to themselves
            a, b = first.contiguous(), again.contiguous()
            bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
            diff = a.view(bits) != b.view(bits)
            same = not bool(diff.any())
        if not same:
            where = tuple(int(j) for j in diff.nonzero()[0]) if again.shape == first.shape else "shape/dtype"
            count = int(diff.sum()) if again.shape == first.shape and again.dtype == first.dtype else "all"
            raise AssertionError(
                f"run {i + 1} of {repeats} differs bitwise from run 1 ({count} elements, first at {where})"
                f"\n  {describe_inputs(run)}"
            )


# ----------------------------------------------------------------------------------------- single rounding
#: The checks that hold a backend to ONE round-to-nearest after an fp32-or-better accumulation of exact products
#: (:mod:`conformance.dense.single_rounding`). Stricter than the error-bound contract: a backend that rounds twice on
#: purpose (e.g. BF16 split-K partials) passes the bound and fails these; it can accept them per backend in its
#: expectation file (``conformance/dense/test_dense.py::test_dense_single_rounding[<backend>-``). They run on the
#: cases that list them in ``DenseCase.strict_checks`` (``alpha`` a power of two or 1.5 times one, so that every
#: dequantized weight is a BF16 number, the contract's other roundings vanish and ``d`` is the accumulation
#: allowance alone).
STRICT_CHECKS = ("check_correctly_rounded", "check_rounding_direction", "check_ulp_error_spread")


def single_rounding_figures(run: DenseRun) -> RoundingFigures:
    """:func:`conformance.dense.single_rounding.rounding_figures` of the run (computed once, kept on it)."""
    cached = run.__dict__.get("_rounding_figures")
    if cached is None:
        check_output_dtype_and_shape(run)
        exact, _ = exact_and_bound(run)
        cached = rounding_figures(run.y, exact, pre_rounding_allowance(run))
        object.__setattr__(run, "_rounding_figures", cached)
    return cached


@check("dense", test="test_dense_single_rounding", applies_to=lambda case: "check_correctly_rounded" in case.strict_checks)
def check_correctly_rounded(run: DenseRun) -> RoundingFigures:
    """[strict] Every *decidable* element (every value within the pre-rounding allowance of ``y*`` rounds to the
    same bf16 number) equals ``RN_bf16(y*)``. No false failures for a single-rounding implementation: it is the
    contract's own model, checked exactly. An extra rounding anywhere (BF16 partial sums, an FP32 -> BF16
    conversion that truncates, an fp16 step) changes some of them."""
    fig = single_rounding_figures(run)
    assert fig.decidable >= MIN_DECIDABLE_ELEMENTS, (
        f"only {fig.decidable} decidable elements (need {MIN_DECIDABLE_ELEMENTS}): the case cannot judge "
        f"single rounding\n  {describe_inputs(run)}"
    )
    if fig.mismatches:
        exact, _ = exact_and_bound(run)
        idx = fig.first_mismatch
        e = exact[idx].reshape(1)
        raise AssertionError(
            f"{fig.mismatches} of {fig.decidable} decidable outputs are not the round-to-nearest bf16 value of the "
            f"exact result (an extra rounding in the datapath?); first at {idx}: got {float(run.y[idx])!r}, "
            f"exact {float(e)!r}, round-to-nearest {float(round_to_bf16_exact(e))!r}, bf16 ulp "
            f"{float(bf16_ulp(e)):.4g}, pre-rounding allowance {float(pre_rounding_allowance(run)[idx]):.4g}"
            f"\n  {describe_inputs(run)}"
        )
    return fig


def _enough_elements(run: DenseRun, count: int, statistic: str) -> None:
    """The strict statistics decide nothing on fewer than MIN_STATISTIC_ELEMENTS elements: fail naming the count."""
    assert count >= MIN_STATISTIC_ELEMENTS, (
        f"only {count} elements inform {statistic} (need {MIN_STATISTIC_ELEMENTS})\n  {describe_inputs(run)}"
    )


@check("dense", test="test_dense_single_rounding", applies_to=lambda case: "check_rounding_direction" in case.strict_checks)
def check_rounding_direction(run: DenseRun) -> RoundingFigures:
    """[strict] Among outputs whose allowance is <= 1/8 ulp, the share rounded toward zero stays below
    ``5/8 + t`` (round-to-nearest: ~1/2; truncation: ~1). False-failure probability <= 1e-9 per evaluation
    (Hoeffding, :mod:`conformance.dense.single_rounding`)."""
    fig = single_rounding_figures(run)
    _enough_elements(run, fig.informative, "the direction statistic")
    assert fig.toward_zero_fraction <= fig.direction_limit, (
        f"{fig.toward_zero_fraction:.3f} of {fig.informative} outputs are rounded toward zero (limit "
        f"{fig.direction_limit:.3f}; round-to-nearest gives ~0.5): the final FP32 -> BF16 conversion truncates?"
        f"\n  {describe_inputs(run)}"
    )
    return fig


@check("dense", test="test_dense_single_rounding", applies_to=lambda case: "check_ulp_error_spread" in case.strict_checks)
def check_ulp_error_spread(run: DenseRun) -> RoundingFigures:
    """[strict] The mean squared error in bf16 ulps over the same elements stays below its single-rounding
    expectation (1/12 plus the allowance terms) plus a Hoeffding margin for a false-failure probability
    <= 1e-9: the calibrated summary threshold (FlashInfer's rel-L2 < 2e-2 is ten times looser)."""
    fig = single_rounding_figures(run)
    _enough_elements(run, fig.eligible, "the error spread")
    assert fig.mean_sq_ulps <= fig.mean_sq_ulps_limit, (
        f"mean squared error {fig.mean_sq_ulps:.4f} ulp^2 over {fig.eligible} outputs exceeds the single-rounding "
        f"limit {fig.mean_sq_ulps_limit:.4f} (expected <= {fig.mean_sq_ulps_expected:.4f}): more than one rounding?"
        f"\n  {describe_inputs(run)}"
    )
    return fig


def check_within_error_bound_figures(run: DenseRun) -> ErrorFigures:
    """The figures of :func:`check_within_error_bound` without asserting the bound (for the summary check)."""
    check_output_dtype_and_shape(run)
    exact, bound = exact_and_bound(run)
    return error_figures(run.y, exact, bound)


def failing_checks(backend: Backend, case: DenseCase) -> dict[str, str]:
    """Run every named check on one case; ``{check name: first line of its failure}`` for those that fail."""
    return failing_checks_of_run(run_dense_case(backend, case), backend)


def failing_checks_of_run(run: DenseRun, backend: Backend) -> dict[str, str]:
    """:func:`failing_checks` on a run already made (its figures stay available to the caller)."""
    return _failing("dense", run, backend)


#: ``{name: registered check}`` of the dense area, each callable as ``check(run, backend)`` (kept for 0.2 code)
NAMED_CHECKS = view("dense")
