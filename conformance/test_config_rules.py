"""SPEC.md section 4: dense quant-mode resolution, FP4 GEMM dispatch, MoE mode, A2A/dispatch validation,
fusion guards. Each case is one combination from fixtures/config_rules/<matrix>.json."""
from __future__ import annotations

import pytest

from conformance.cases import as_params
from conformance.engines.matrix import check_case, load_matrix


def _check(rules_engine, case) -> None:
    reason = rules_engine.unsupported(case.matrix, case.inputs)
    if reason:
        pytest.skip(reason)
    check_case(rules_engine, case)


@pytest.mark.parametrize("case", as_params(load_matrix("dense")))
def test_dense(rules_engine, case):
    _check(rules_engine, case)


@pytest.mark.parametrize("case", as_params(load_matrix("fp4_gemm")))
def test_fp4_gemm(rules_engine, case):
    _check(rules_engine, case)


@pytest.mark.parametrize("case", as_params(load_matrix("moe")))
def test_moe(rules_engine, case):
    _check(rules_engine, case)


@pytest.mark.parametrize("case", as_params(load_matrix("a2a")))
def test_a2a(rules_engine, case):
    _check(rules_engine, case)


@pytest.mark.parametrize("case", as_params(load_matrix("fusion")))
def test_fusion(rules_engine, case):
    _check(rules_engine, case)
