"""Engine-side integration bugs, planted by patching SGLang 0.5.23 functions, must each be caught by a
named check of the engine harness (``conformance/engine_harness/checks.py``). The unpatched engine
passes the same cases (``conformance/engine_harness/test_engine_integration.py``); here every mutant must fail the
check it is listed with. Skips (with the reason) when SGLang is not importable.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from conformance._framework.cases import as_params
from conformance.dense.cases import DenseCase
from conformance.engine_harness.cases import DENSE_CASES, MOE_CASES, EngineDenseCase
from conformance.engine_harness.checks import failing_checks
from conformance.adapters.sglang.layer_code import SGLangLayerCode

_CASES = {c.id: c for c in [*DENSE_CASES, *MOE_CASES]}
# N = 256 and K/16 = 8 fill whole 128x4 tiles: linear scales then have exactly the swizzled byte count, so
# handing them to prepare is not rejected by size and must be caught by the numbers.
_FULL_TILES = EngineDenseCase("dense-w4a16-full-tiles", "w4a16", DenseCase("engine-full-tiles", "cpu", (4,), 256, 128))


@dataclass(frozen=True)
class EngineMutant:
    id: str
    plant: Callable[[pytest.MonkeyPatch], None]
    case: object
    caught_by: str
    tier: str = "cpu"


def _mq():
    from sglang.srt.layers.quantization import modelopt_quant

    return modelopt_quant


# ------------------------------------------------------------------------------------------ plants
def _alpha_includes_input_scale(mp: pytest.MonkeyPatch) -> None:
    """W4A16 prepare receives the W4A4 alpha ``input_scale * weight_scale_2``."""
    mq = _mq()
    original = mq.ModelOptFp4LinearMethod.process_weights_after_loading

    def mutated(self, layer):
        if self.quant_mode != "w4a16":
            return original(self, layer)
        from flashinfer import prepare_bf16_fp4_weights

        alpha = (layer.input_scale.max() * layer.weight_scale_2.max()).to(torch.float32).reshape(1)
        weight, scale, alpha = prepare_bf16_fp4_weights(
            layer.weight, mq.swizzle_blockscale(layer.weight_scale), alpha, backend="cute-dsl"
        )
        mq.copy_or_rebind_param(layer, "weight", weight)
        mq.copy_or_rebind_param(layer, "weight_scale_interleaved", scale)
        mq.copy_or_rebind_param(layer, "alpha", alpha)

    mp.setattr(mq.ModelOptFp4LinearMethod, "process_weights_after_loading", mutated)


def _pre_quant_scale_skipped(mp: pytest.MonkeyPatch) -> None:
    """``apply`` forgets the NVFP4_AWQ per-channel pre-scaling of the activations."""
    mq = _mq()
    original = mq.ModelOptFp4LinearMethod.apply

    def mutated(self, layer, x, bias=None):
        saved = self.quant_config.is_awq
        self.quant_config.is_awq = False
        try:
            return original(self, layer, x, bias)
        finally:
            self.quant_config.is_awq = saved

    mp.setattr(mq.ModelOptFp4LinearMethod, "apply", mutated)


def _unswizzled_scales_to_prepare(mp: pytest.MonkeyPatch) -> None:
    """The linear checkpoint scales go to ``prepare_bf16_fp4_weights`` instead of the 128x4 swizzle."""
    mp.setattr(_mq(), "swizzle_blockscale", lambda scale: scale)


def _activations_quantized(mp: pytest.MonkeyPatch) -> None:
    """Under W4A16 the activations are NVFP4-quantized (and dequantized) before the GEMM, as on W4A4."""
    mq = _mq()
    original = mq.ModelOptFp4LinearMethod.apply

    def mutated(self, layer, x, bias=None):
        from reference_impl.nvfp4 import dequantize, quantize_kernel

        global_sf = 1.0 / layer.input_scale.max().float()
        packed, sf = quantize_kernel(x.reshape(-1, x.shape[-1]), global_sf)
        x = dequantize(packed, sf, 1.0 / global_sf).to(x.dtype).reshape(x.shape)
        return original(self, layer, x, bias)

    mp.setattr(mq.ModelOptFp4LinearMethod, "apply", mutated)


def _fc2_input_scale_passed(mp: pytest.MonkeyPatch) -> None:
    """The MoE runner passes the W4A4 ``fc2_input_scale`` to ``CuteDslMoEWrapper.run`` under W4A16."""
    from sglang.srt.layers.moe.moe_runner import flashinfer_cutedsl as fc

    original = fc.ensure_cutedsl_wrapper

    def mutated(layer):
        original(layer)
        wrapper = layer._cutedsl_wrapper
        if getattr(wrapper, "_harness_mutated", False):
            return
        run = wrapper.run

        def run_with_fc2(*args, **kwargs):
            kwargs["fc2_input_scale"] = layer.w2_input_scale_quant.reshape(-1)[:1].float()
            return run(*args, **kwargs)

        wrapper.run = run_with_fc2
        wrapper._harness_mutated = True

    mp.setattr(fc, "ensure_cutedsl_wrapper", mutated)


def _moe_alpha_includes_input_scale(mp: pytest.MonkeyPatch) -> None:
    """The MoE GEMM alphas keep the checkpoint input scales under W4A16 (not neutralized to 1)."""
    from sglang.srt.layers.moe.moe_runner import flashinfer_cutedsl as fc

    original = fc.resolve_cutedsl_standard_scales

    def mutated(layer):
        w1_alpha, fc2_input_scale, w2_alpha, used = original(layer)
        lo = layer.moe_ep_rank * layer.num_local_experts
        sel = slice(lo, lo + layer.num_local_experts)
        w1_alpha = w1_alpha * layer.w13_input_scale.max(dim=-1).values[sel].float()
        w2_alpha = w2_alpha * layer.w2_input_scale[sel].float()
        return w1_alpha, fc2_input_scale, w2_alpha, used

    mp.setattr(fc, "resolve_cutedsl_standard_scales", mutated)


def _reload_rebinds(mp: pytest.MonkeyPatch) -> None:
    """Post-load processing rebinds parameter storage (``param.data = new``) even when shape and dtype
    are unchanged, instead of copying into it: the address a captured CUDA graph reads goes stale."""
    mq = _mq()

    def always_rebind(module, name, new_value):
        param = getattr(module, name, None)
        if isinstance(param, torch.nn.Parameter):
            param.data = new_value.detach().clone()
        else:
            setattr(module, name, torch.nn.Parameter(new_value.detach(), requires_grad=False))

    mp.setattr(mq, "copy_or_rebind_param", always_rebind)


MUTANTS = [
    EngineMutant("w4a16-alpha-includes-input-scale", _alpha_includes_input_scale, _CASES["dense-w4a16-plain"], "output_within_bound"),
    EngineMutant("w4a16-awq-pre-quant-scale-skipped", _pre_quant_scale_skipped, _CASES["dense-w4a16-awq"], "output_within_bound"),
    EngineMutant("w4a16-unswizzled-scales-too-small", _unswizzled_scales_to_prepare, _CASES["dense-w4a16-plain"], "scenario_completes"),
    EngineMutant("w4a16-unswizzled-scales-same-size", _unswizzled_scales_to_prepare, _FULL_TILES, "output_within_bound"),
    EngineMutant("w4a16-activations-quantized", _activations_quantized, _CASES["dense-w4a16-plain"], "output_within_bound"),
    EngineMutant("moe-w4a16-alpha-includes-input-scale", _moe_alpha_includes_input_scale, _CASES["moe-w4a16-4-experts"], "output_within_bound"),
    EngineMutant("moe-w4a16-fc2-input-scale-passed", _fc2_input_scale_passed, _CASES["moe-w4a16-4-experts"], "scenario_completes"),
    EngineMutant("w4a16-reload-rebinds-same-shape", _reload_rebinds, _CASES["dense-w4a16-plain"], "reload_keeps_identity"),
    EngineMutant("moe-w4a16-reload-rebinds-same-shape", _reload_rebinds, _CASES["moe-w4a16-4-experts"], "reload_keeps_identity"),
]


@pytest.fixture(scope="module")
def sglang_adapter():
    adapter = SGLangLayerCode()
    reason = adapter.skip_reason()
    if reason:
        pytest.skip(reason)
    return adapter


@pytest.mark.parametrize("mutant", as_params(MUTANTS))
def test_engine_mutant_is_caught(sglang_adapter, mutant: EngineMutant, monkeypatch):
    mutant.plant(monkeypatch)
    failures = failing_checks(sglang_adapter, mutant.case)
    assert mutant.caught_by in failures, (
        f"mutant {mutant.id} not caught by {mutant.caught_by}; failing checks: {failures or 'none'}"
    )


def test_unmutated_full_tile_case_passes(sglang_adapter):
    """The control for the same-size unswizzled mutant: the real SGLang passes this case."""
    assert failing_checks(sglang_adapter, _FULL_TILES) == {}
