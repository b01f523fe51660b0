"""FlashInfer-A2A prefill bugs planted in SGLang 0.5.23 must each be caught by a named check of
conformance/engine_harness/a2a_prefill.py (the unpatched engine passes: conformance/engine_harness/test_engine_a2a_paths.py).
Skips (with the reason) when SGLang is not importable."""
from __future__ import annotations

import pytest

from conformance.engine_harness.a2a_prefill import PREFILL_CASES, prefill_failures
from conformance.adapters.sglang.layer_code import SGLangLayerCode

_CASES = {c.id: c for c in PREFILL_CASES}


def _cutedsl():
    from sglang.srt.layers.moe.moe_runner import flashinfer_cutedsl

    return flashinfer_cutedsl


def _prefill_returns_flashinfer_combine(mp):
    """The eager-prefill branch returns a FlashInfer combine input: the dispatcher cannot reduce-scatter it."""
    from sglang.srt.layers.moe.token_dispatcher.flashinfer import FlashinferCombineInput

    fc = _cutedsl()
    original = fc.fused_experts_none_to_flashinfer_cutedsl_fp4
    mp.setattr(fc, "fused_experts_none_to_flashinfer_cutedsl_fp4",
               lambda *a, **k: FlashinferCombineInput(hidden_states=original(*a, **k).hidden_states))


def _decode_scale_as_encode_scale(mp):
    """The activation quantizer gets the checkpoint's decode scale (input_scale) where FlashInfer wants the
    encode scale (1 / input_scale): the two global-scale conventions confused (docs/contracts.md section 1)."""
    fc = _cutedsl()
    original = fc.cutedsl_quant_scale_to_scalar
    mp.setattr(fc, "cutedsl_quant_scale_to_scalar", lambda q, *, name: 1.0 / original(q, name=name))


def _w4a16_wrapper_built_as_w4a4(mp):
    """The CuTe DSL wrapper is built W4A4 whatever the W4A16 switch says: BF16 activations get quantized."""
    import os

    fc = _cutedsl()
    original = fc.ensure_cutedsl_wrapper

    def ensure(layer):
        saved = os.environ.pop("SGLANG_FLASHINFER_CUTEDSL_NVFP4_W4A16", None)
        try:
            original(layer)
        finally:
            if saved is not None:
                os.environ["SGLANG_FLASHINFER_CUTEDSL_NVFP4_W4A16"] = saved

    mp.setattr(fc, "ensure_cutedsl_wrapper", ensure)


MUTANTS = [  # (plant, case, check that must fail)
    (_prefill_returns_flashinfer_combine, "moe-w4a4-flashinfer-a2a-prefill", "standard_combine"),
    (_prefill_returns_flashinfer_combine, "moe-w4a16-flashinfer-a2a-prefill", "standard_combine"),
    (_decode_scale_as_encode_scale, "moe-w4a4-flashinfer-a2a-prefill", "activations"),
    (_w4a16_wrapper_built_as_w4a4, "moe-w4a16-flashinfer-a2a-prefill", "activations"),
    (_w4a16_wrapper_built_as_w4a4, "moe-w4a16-flashinfer-a2a-prefill", "output_within_bound"),
]


@pytest.fixture(scope="module")
def sglang_adapter():
    adapter = SGLangLayerCode()
    reason = adapter.skip_reason()
    if reason:
        pytest.skip(reason)
    return adapter


@pytest.mark.parametrize("plant, case_id, check", MUTANTS, ids=[f"{p.__name__.strip('_')}-{c}-{k}" for p, c, k in MUTANTS])
def test_a2a_prefill_mutant_is_caught(sglang_adapter, plant, case_id, check, monkeypatch):
    plant(monkeypatch)
    failures = prefill_failures(sglang_adapter, _CASES[case_id])
    assert check in failures, f"{plant.__name__} not caught by {check}; failing checks: {failures or 'none'}"
