"""docs/contracts.md section 5: which LM-head states run which quantized method (incl. stale methods on dense heads)."""
from __future__ import annotations

import pytest

from conformance._framework.cases import as_params
from conformance.rules.matrix import load_matrix


@pytest.mark.parametrize("case", as_params(load_matrix("lm_head")))
def test_lm_head(rules_check, case):
    rules_check(case)
