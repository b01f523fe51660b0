"""An engine's flashinfer_cutedsl MoE runner on the FlashInfer-A2A eager-prefill path (cpu tier, FlashInfer
emulator): a standard combine input comes back, W4A4 quantizes the activations with the CuTe DSL scalar
scale, W4A16 keeps them BF16 and matches the checkpoint reference. Checks: conformance/engine_harness/a2a_prefill.py."""
from __future__ import annotations

import pytest

from conformance._framework.cases import as_params
from conformance.engine_harness.a2a_prefill import PREFILL_CASES, prefill_failures, prefill_runner


@pytest.mark.parametrize("case", as_params(PREFILL_CASES))
def test_flashinfer_a2a_prefill(engine_adapter, case):
    if prefill_runner(engine_adapter) is None:
        pytest.skip(f"engine adapter {engine_adapter.name!r} has no FlashInfer-A2A prefill scenario")
    failures = prefill_failures(engine_adapter, case)
    assert not failures, "\n".join(f"[{name}] {msg}" for name, msg in failures.items())
