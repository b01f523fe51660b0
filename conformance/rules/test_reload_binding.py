"""docs/contracts.md section 6: weight reload keeps Parameter objects and data pointers when it can, rebinds otherwise,
and asks for a CUDA graph recapture when captured state would move; derived tensors (e.g. swizzled block
scales) alias their source's storage when they fit in it."""
from __future__ import annotations

import pytest

from conformance._framework.cases import as_params
from conformance.rules.matrix import load_matrix


@pytest.mark.parametrize("case", as_params(load_matrix("reload")))
def test_reload(rules_check, case):
    rules_check(case)


@pytest.mark.parametrize("case", as_params(load_matrix("derived_param")))
def test_derived_param(rules_check, case):
    rules_check(case)
