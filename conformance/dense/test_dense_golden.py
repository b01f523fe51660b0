"""The backend under test (``--backend``) against the golden data the suite ships (fixtures/snapshots/): the
canonical dense cases' inputs are rebuilt on the CPU and must hash to the value stored with the golden output;
they are then moved to the backend's device (a ``b200`` backend: the GPU) and the backend's output is judged
against the stored exact value ``exact_fp64`` within the derived dense bound. The truth here is the stored
file, not the reference code of this checkout (:func:`conformance.dense.golden.check_dense_golden`)."""
from __future__ import annotations

import pytest

from conformance.interfaces.kernel import Backend
from conformance._framework.cases import as_params, case_for_backend
from conformance._framework.diagnosis import appending_diagnoses
from conformance.dense.checks import failing_checks_of_run, run_dense_case
from conformance.dense.diagnosis import diagnose_run
from conformance.dense.cases import DENSE_CASES
from conformance.dense.golden import CANONICAL, check_dense_golden

GOLDEN_CASES = [c for c in DENSE_CASES if c.id in CANONICAL]


@pytest.mark.parametrize("case", as_params(GOLDEN_CASES))
def test_dense_matches_golden(backend: Backend, case, record_property) -> None:
    reason = backend.skip_reason(case_for_backend(case, backend).info())
    if reason:
        pytest.skip(reason)
    # a failure is diagnosed like the live cases': the same case run on the backend, every named check and rule
    # evaluated (only when the golden comparison has failed)
    with appending_diagnoses(lambda: _diagnoses(backend, case), record_property):
        fig = check_dense_golden(backend, case)
    for name, value in fig.properties().items():
        record_property(name, value)


def _diagnoses(backend: Backend, case):
    run = run_dense_case(backend, case_for_backend(case, backend))
    return diagnose_run(run, failing_checks_of_run(run, backend))
