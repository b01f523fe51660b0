"""Dense W4A16 conformance: the backend under test (``--backend``) against the exact value and its derived
bound. Cases are data (:mod:`conformance.dense.cases`); each test runs the checks registered for it
(``@check("dense", test=...)`` in :mod:`conformance.dense.checks`), each on the cases it applies to."""
from __future__ import annotations

import pytest

from conformance.interfaces.kernel import Backend
from conformance._framework.cases import as_params, case_for_backend
from conformance._framework.checks import checks_for
from conformance.dense.checks import check_output_dtype_and_shape, run_dense_case, single_rounding_figures
from conformance.dense.diagnosis import diagnosed
from conformance.dense.cases import DENSE_CASES, NONFINITE_CASES, SINGLE_ROUNDING_CASES, DenseCase


def _run(backend: Backend, case: DenseCase):
    case = case_for_backend(case, backend)  # on the backend's tier's device (a b200 backend: the GPU)
    reason = backend.skip_reason(case.info())
    if reason:
        pytest.skip(reason)
    return run_dense_case(backend, case)


def _judge(test: str, backend: Backend, case: DenseCase, record_property) -> None:
    """Run the checks registered for ``test`` that apply to ``case``; figures go to the report first."""
    run = _run(backend, case)
    with diagnosed(run, backend, record_property):
        for check in checks_for("dense", test):
            if check.applies(run.case):
                check(run, backend, record=lambda fig: _record(record_property, fig))


def _record(record_property, figures) -> None:
    for name, value in figures.properties().items():
        record_property(name, value)


@pytest.mark.parametrize("case", as_params(DENSE_CASES))
def test_dense_matches_reference(backend: Backend, case: DenseCase, record_property) -> None:
    _judge("test_dense_matches_reference", backend, case, record_property)


@pytest.mark.parametrize("case", as_params(DENSE_CASES))
def test_dense_output_dtype_and_shape(backend: Backend, case: DenseCase, record_property) -> None:
    _judge("test_dense_output_dtype_and_shape", backend, case, record_property)


@pytest.mark.parametrize("case", as_params(DENSE_CASES))
def test_dense_deterministic(backend: Backend, case: DenseCase, record_property) -> None:
    _judge("test_dense_deterministic", backend, case, record_property)


@pytest.mark.parametrize("case", as_params(NONFINITE_CASES))
def test_dense_nonfinite_policy(backend: Backend, case: DenseCase, record_property) -> None:
    _judge("test_dense_nonfinite_policy", backend, case, record_property)


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
        for check in checks_for("dense", "test_dense_single_rounding"):
            if check.applies(run.case):
                check(run, backend)
