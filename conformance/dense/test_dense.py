"""Dense W4A16 conformance: the backend under test (``--backend``) against the exact value and its derived
bound. Cases are data (:mod:`conformance.dense.cases`); checks live in :mod:`conformance.dense.checks`."""
from __future__ import annotations

import pytest

from conformance.interfaces.kernel import Backend
from conformance._framework.cases import as_params, case_for_backend
from conformance.dense.checks import (
    NAMED_CHECKS,
    check_deterministic,
    check_nonfinite_policy,
    check_output_dtype_and_shape,
    check_summary_figures,
    check_within_error_bound,
    run_dense_case,
    single_rounding_figures,
)
from conformance.dense.diagnosis import diagnosed
from conformance.dense.cases import DENSE_CASES, NONFINITE_CASES, SINGLE_ROUNDING_CASES, DenseCase


def _run(backend: Backend, case: DenseCase):
    case = case_for_backend(case, backend)  # on the backend's tier's device (a b200 backend: the GPU)
    reason = backend.skip_reason(case.info())
    if reason:
        pytest.skip(reason)
    return run_dense_case(backend, case)


@pytest.mark.parametrize("case", as_params(DENSE_CASES))
def test_dense_matches_reference(backend: Backend, case: DenseCase, record_property) -> None:
    run = _run(backend, case)
    with diagnosed(run, backend, record_property):
        figures = check_within_error_bound(run, record=lambda fig: _record(record_property, fig))
        check_summary_figures(figures, run)


def _record(record_property, figures) -> None:
    for name, value in figures.properties().items():
        record_property(name, value)


@pytest.mark.parametrize("case", as_params(DENSE_CASES))
def test_dense_output_dtype_and_shape(backend: Backend, case: DenseCase, record_property) -> None:
    run = _run(backend, case)
    with diagnosed(run, backend, record_property):
        check_output_dtype_and_shape(run)


@pytest.mark.parametrize("case", as_params(DENSE_CASES))
def test_dense_deterministic(backend: Backend, case: DenseCase, record_property) -> None:
    run = _run(backend, case)
    with diagnosed(run, backend, record_property):
        check_deterministic(run, backend)


@pytest.mark.parametrize("case", as_params(NONFINITE_CASES))
def test_dense_nonfinite_policy(backend: Backend, case: DenseCase, record_property) -> None:
    run = _run(backend, case)
    with diagnosed(run, backend, record_property):
        check_nonfinite_policy(run)


@pytest.mark.parametrize("case", as_params(SINGLE_ROUNDING_CASES))
def test_dense_single_rounding(backend: Backend, case: DenseCase, record_property) -> None:
    """[strict: stricter than the error bound] exactly one round-to-nearest after the fp32 sum
    (``conformance.dense.checks.STRICT_CHECKS``); a backend may accept it in its expectation file."""
    run = _run(backend, case)
    check_output_dtype_and_shape(run)
    record_property("strict", "single rounding (stricter than the error-bound contract)")
    for name, value in single_rounding_figures(run).properties().items():
        record_property(name, value)
    with diagnosed(run, backend, record_property):
        for name in case.strict_checks:
            NAMED_CHECKS[name](run, backend)
