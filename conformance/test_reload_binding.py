"""SPEC.md section 6: weight reload keeps Parameter objects and data pointers when it can, rebinds otherwise."""
from __future__ import annotations

import pytest

from conformance.cases import as_params
from conformance.engines.matrix import check_case, load_matrix


@pytest.mark.parametrize("case", as_params(load_matrix("reload")))
def test_reload(rules_engine, case):
    reason = rules_engine.unsupported(case.matrix, case.inputs)
    if reason:
        pytest.skip(reason)
    check_case(rules_engine, case)
