"""examples/humming_w4a16_backend.py on a machine without humming-kernels (CI, CPU only): it imports, reports
itself as unavailable, and every case is declined with the reason, so a vendor sees why nothing ran (issue 25)."""
from __future__ import annotations

import importlib
import sys

import pytest
import torch

from conformance.interfaces.kernel import CaseInfo


@pytest.fixture
def example_without_humming(monkeypatch):
    monkeypatch.setitem(sys.modules, "humming", None)  # import humming raises ImportError, installed or not
    monkeypatch.delitem(sys.modules, "examples.humming_w4a16_backend", raising=False)
    return importlib.import_module("examples.humming_w4a16_backend")


def test_imports_and_declines_every_case_with_the_reason(example_without_humming):
    backend = example_without_humming.HummingW4A16Backend()
    assert "humming-kernels not available" in backend.version()
    cases = [CaseInfo("dense", torch.device("cpu"), {"m": 1, "n": 128, "k": 128}),
             CaseInfo("moe", torch.device("cpu"), {"tokens": 4, "experts": 2, "top_k": 1, "hidden": 128,
                                                   "intermediate": 128})]
    for case in cases:
        reason = backend.skip_reason(case)
        assert reason is not None and "humming-kernels is not importable" in reason, reason
        assert "pip install" in reason  # the install hint travels with the reason
