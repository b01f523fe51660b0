"""W4A16 fused-MoE conformance: the backend under test (``--backend``) against the exact value and its
derived bound, on every expert-parallel rank. Cases are data (:mod:`conformance.moe.cases`); each test runs the
checks registered for it (``@check("moe", ..., test=...)`` in :mod:`conformance.moe.checks`)."""
from __future__ import annotations

import pytest

from conformance.interfaces.kernel import Backend
from conformance._framework.cases import as_params, case_for_backend
from conformance._framework.checks import checks_for
from conformance.moe.checks import check_moe_prepared_reuse, run_moe_case
from conformance.moe.diagnosis import diagnosed
from conformance.moe.cases import MOE_CASES, MoECase

EP_CASES = [c for c in MOE_CASES if c.ep_size > 1]
#: Input-scale neutrality on a spread of layouts (EP ranks, untied gate/up, each activation), not every case.
SCALE_CASES = [
    c for c in MOE_CASES
    if c.input_scales and (c.ep_size > 1 or c.gate_up != "tied" or c.activation != "swiglu" or c.tokens == 7)
    and (c.tier == "cpu" or c.id == "cuda_t128_e256_k8_h4096_i1536_gate_up_pow2")
]


def _run(backend: Backend, case: MoECase):
    case = case_for_backend(case, backend)  # on the backend's tier's device (a b200 backend: the GPU)
    reason = backend.skip_reason(case.info())
    if reason:
        pytest.skip(reason)
    try:
        return run_moe_case(backend, case)
    except NotImplementedError as exc:  # the adapter's documented way to declare "no fused MoE"
        pytest.skip(f"{backend.name}: {exc}")


@pytest.mark.parametrize("case", as_params(MOE_CASES))
def test_moe_matches_reference(backend: Backend, case: MoECase, record_property) -> None:
    run = _run(backend, case)
    with diagnosed(run, backend, record_property):
        for check in checks_for("moe", "test_moe_matches_reference"):
            if check.applies(run.case):
                check(run, backend, record=lambda fig: _record(record_property, fig))


@pytest.mark.parametrize("case", as_params(MOE_CASES))
def test_moe_prepared_reuse(backend: Backend, case: MoECase, record_property) -> None:
    """The same prepared experts on a second batch (the tokens rolled by one row): no state from the first call."""
    run = _run(backend, case)
    with diagnosed(lambda: run_moe_case(backend, run.case), backend, record_property):  # run's buffers are reused
        fig = check_moe_prepared_reuse(run, backend)
    record_property("reuse_bound_ratio", fig.bound_ratio)


@pytest.mark.parametrize("case", as_params(EP_CASES))
def test_moe_expert_parallel_sum(backend: Backend, case: MoECase, record_property) -> None:
    run = _run(backend, case)
    with diagnosed(run, backend, record_property):
        for check in checks_for("moe", "test_moe_expert_parallel_sum"):
            check(run, backend)


@pytest.mark.parametrize("case", as_params(SCALE_CASES))
def test_moe_input_scales_ignored(backend: Backend, case: MoECase, record_property) -> None:
    run = _run(backend, case)
    with diagnosed(run, backend, record_property):
        for check in checks_for("moe", "test_moe_input_scales_ignored"):
            check(run, backend)


def _record(record_property, figures) -> None:
    for name, value in figures.properties().items():
        record_property(name, value)
