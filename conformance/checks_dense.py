"""The dense W4A16 checks: plain functions that raise ``AssertionError`` with a readable report.

The conformance tests (``conformance/test_dense.py``) call them on the backend under test; the self-tests
(``tests/test_dense_mutants.py``) call them on deliberately broken backends to prove each can fail.

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

from reference_impl.dense import w4a16_linear_exact

from .adapter import Backend, DenseLayer
from .bounds import FLASHINFER_MAX_REL_L2, FLASHINFER_MIN_COSINE, ErrorFigures, dense_error_bound, error_figures
from .dense_cases import DenseCase, build_activations, build_layer

DETERMINISM_REPEATS = 3


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
        f"rebuild: conformance.dense_cases.build_layer/build_activations(case) (seed {run.case.seed})",
    ]
    return "\n  ".join(parts)


def exact_and_bound(run: DenseRun) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact fp64 output ``y*`` and the per-element bound of :func:`conformance.bounds.dense_error_bound`
    (computed once per run and kept on it: the inputs of a run never change)."""
    cached = run.__dict__.get("_exact_and_bound")
    if cached is not None:
        return cached
    layer = run.layer
    exact, magnitude = w4a16_linear_exact(
        run.x, layer.weight, layer.weight_scale, layer.weight_scale_2, layer.pre_quant_scale, layer.bias
    )
    bound = dense_error_bound(
        exact, magnitude, run.case.k, has_pre_quant_scale=layer.pre_quant_scale is not None, bias=layer.bias
    )
    object.__setattr__(run, "_exact_and_bound", (exact, bound))
    return exact, bound


def check_output_dtype_and_shape(run: DenseRun) -> None:
    """The output is a bfloat16 tensor of shape ``[*x.shape[:-1], N]`` on the input's device."""
    y, x, n = run.y, run.x, run.case.n
    assert isinstance(y, torch.Tensor), f"run_dense returned {type(y).__name__}, not a tensor\n  {describe_inputs(run)}"
    expected = (*x.shape[:-1], n)
    assert y.dtype == torch.bfloat16 and tuple(y.shape) == expected and y.device == x.device, (
        f"output is {y.dtype} {tuple(y.shape)} on {y.device}; expected torch.bfloat16 {expected} on {x.device}"
        f"\n  {describe_inputs(run)}"
    )


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


def check_summary_figures(fig: ErrorFigures, run: DenseRun) -> None:
    """The acceptance of FlashInfer's dense W4A16 GEMM test (``tests/gemm/test_mm_bf16_fp4.py``,
    ``_assert_close_to_reference``: relative L2 < 2e-2, cosine > 0.999), looser than the bound: kept so a
    report can say the backend also meets the upstream thresholds."""
    assert fig.rel_l2 < FLASHINFER_MAX_REL_L2 and fig.cosine > FLASHINFER_MIN_COSINE, (
        f"relative L2 {fig.rel_l2:.4g} (limit {FLASHINFER_MAX_REL_L2}) / cosine {fig.cosine:.6f} "
        f"(limit {FLASHINFER_MIN_COSINE})\n  {describe_inputs(run)}"
    )


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


#: Named checks, each ``(DenseRun, Backend) -> None``; the mutant self-tests report which ones fire.
NAMED_CHECKS: dict[str, Callable[[DenseRun, Backend], Any]] = {
    "check_output_dtype_and_shape": lambda run, backend: check_output_dtype_and_shape(run),
    "check_within_error_bound": lambda run, backend: check_within_error_bound(run),
    "check_summary_figures": lambda run, backend: check_summary_figures(check_within_error_bound_figures(run), run),
    "check_nonfinite_policy": lambda run, backend: (
        check_nonfinite_policy(run) if run.case.x_kind == "nonfinite" else None
    ),
    "check_deterministic": lambda run, backend: check_deterministic(run, backend),
}


def check_within_error_bound_figures(run: DenseRun) -> ErrorFigures:
    """The figures of :func:`check_within_error_bound` without asserting the bound (for the summary check)."""
    check_output_dtype_and_shape(run)
    exact, bound = exact_and_bound(run)
    return error_figures(run.y, exact, bound)


def failing_checks(backend: Backend, case: DenseCase) -> dict[str, str]:
    """Run every named check on one case; ``{check name: first line of its failure}`` for those that fail."""
    run = run_dense_case(backend, case)
    failures = {}
    for name, check in NAMED_CHECKS.items():
        try:
            check(run, backend)
        except AssertionError as exc:
            failures[name] = str(exc).splitlines()[0]
    return failures
