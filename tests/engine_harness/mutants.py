"""Engine-side integration bugs ("engine mutants"), as data per engine: each plants one bug by patching the real
engine's functions (SGLang 0.5.23, vLLM 0.32) and names the engine-harness check that must catch it on its case;
the unpatched engine passes the same cases (``conformance/engine_harness/test_engine_integration.py``,
``conformance/engine_harness/test_engine_a2a_paths.py``) and the controls below. The runner is
tests/engine_harness/test_engine_mutants.py.

Two harnesses judge them: the layer harness (``conformance/engine_harness/checks.py``, :func:`failing_checks`) and
the FlashInfer-A2A prefill harness (``conformance/engine_harness/a2a_prefill.py``, :func:`prefill_failures`).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from conformance.dense.cases import DenseCase
from conformance.engine_harness.a2a_prefill import PREFILL_CASES, prefill_failures
from conformance.engine_harness.cases import DENSE_CASES, MOE_CASES, EngineDenseCase
from conformance.engine_harness.checks import failing_checks
from tests.helpers import built_as_w4a4

_CASES = {c.id: c for c in [*DENSE_CASES, *MOE_CASES]}
_PREFILL = {c.id: c for c in PREFILL_CASES}
# N = 256 and K/16 = 8 fill whole 128x4 tiles: linear scales then have exactly the swizzled byte count, so
# handing them to prepare unswizzled is not rejected by size and must be caught by the numbers.
_FULL_TILES = EngineDenseCase("dense-w4a16-full-tiles", "w4a16", DenseCase("engine-full-tiles", "cpu", (4,), 256, 128))


@dataclass(frozen=True)
class EngineMutant:
    id: str
    plant: Callable[[pytest.MonkeyPatch], None]
    case: object
    caught_by: str
    #: the harness that judges the case: (engine, case) -> {failing check: message}
    failures: Callable[[object, object], dict] = failing_checks
    tier: str = "cpu"


def _a2a(id: str, plant, case_id: str, caught_by: str) -> EngineMutant:
    return EngineMutant(id, plant, _PREFILL[case_id], caught_by, failures=prefill_failures)


# ================================================================================== SGLang: layer harness
def _mq():
    from sglang.srt.layers.quantization import modelopt_quant

    return modelopt_quant


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
        from reference_impl.format.nvfp4 import dequantize, quantize_kernel

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


# ======================================================================= SGLang: FlashInfer-A2A prefill
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
    fc = _cutedsl()
    mp.setattr(fc, "ensure_cutedsl_wrapper", built_as_w4a4(fc.ensure_cutedsl_wrapper))


# ====================================================================================== vLLM: layer harness
def _modelopt():
    from vllm.model_executor.layers.quantization import modelopt

    return modelopt


def _kernel_module():
    from vllm.model_executor.kernels.linear.nvfp4 import flashinfer

    return flashinfer


def _alpha_from_first_shard(mp: pytest.MonkeyPatch) -> None:
    """The fused layer's global scale is taken from the first shard (q) instead of the maximum over shards."""
    mo = _modelopt()
    original = mo.KNvfp4Static.process

    def mutated(self, layer, role):
        layer.weight_scale_2.data.fill_(layer.weight_scale_2.data[0].item())
        return original(self, layer, role)

    mp.setattr(mo.KNvfp4Static, "process", mutated)


def _alpha_reciprocal(mp: pytest.MonkeyPatch) -> None:
    """The decode scale ``weight_scale_2`` is inverted (read as an encode scale) before prepare."""
    mo = _modelopt()
    original = mo.KNvfp4Static.process

    def mutated(self, layer, role):
        original(self, layer, role)
        layer.weight_global_scale.data.reciprocal_()

    mp.setattr(mo.KNvfp4Static, "process", mutated)


def _scales_not_swizzled(mp: pytest.MonkeyPatch) -> None:
    """The linear checkpoint scales go to ``prepare_bf16_fp4_weights`` without the 128x4 swizzle (padded to the
    swizzled size, so only the byte order is wrong)."""
    km = _kernel_module()

    def linear_padded(scale: torch.Tensor) -> torch.Tensor:
        rows, cols = scale.shape[-2:]
        padded = scale.new_zeros(((rows + 127) // 128) * 128, ((cols + 3) // 4) * 4)
        padded[:rows, :cols] = scale
        return padded

    mp.setattr(km, "swizzle_blockscale", linear_padded)


def _vllm_reload_rebinds(mp: pytest.MonkeyPatch) -> None:
    """A reload keeps the freshly processed tensors instead of copying them into the captured ones."""
    from vllm.model_executor.model_loader.reload import layerwise

    def no_copy(layer, info):
        info.kernel_tensors = ({}, {})

    mp.setattr(layerwise, "_copy_and_restore_kernel_tensors", no_copy)


# ============================================================================================== the data
#: engine -> the mutants planted in it, each with the check that must catch it
MUTANTS: dict[str, list[EngineMutant]] = {
    "sglang": [
        EngineMutant("w4a16-alpha-includes-input-scale", _alpha_includes_input_scale, _CASES["dense-w4a16-plain"], "output_within_bound"),
        EngineMutant("w4a16-awq-pre-quant-scale-skipped", _pre_quant_scale_skipped, _CASES["dense-w4a16-awq"], "output_within_bound"),
        EngineMutant("w4a16-unswizzled-scales-too-small", _unswizzled_scales_to_prepare, _CASES["dense-w4a16-plain"], "scenario_completes"),
        EngineMutant("w4a16-unswizzled-scales-same-size", _unswizzled_scales_to_prepare, _FULL_TILES, "output_within_bound"),
        EngineMutant("w4a16-activations-quantized", _activations_quantized, _CASES["dense-w4a16-plain"], "output_within_bound"),
        EngineMutant("moe-w4a16-alpha-includes-input-scale", _moe_alpha_includes_input_scale, _CASES["moe-w4a16-4-experts"], "output_within_bound"),
        EngineMutant("moe-w4a16-fc2-input-scale-passed", _fc2_input_scale_passed, _CASES["moe-w4a16-4-experts"], "scenario_completes"),
        EngineMutant("w4a16-reload-rebinds-same-shape", _reload_rebinds, _CASES["dense-w4a16-plain"], "reload_keeps_identity"),
        EngineMutant("moe-w4a16-reload-rebinds-same-shape", _reload_rebinds, _CASES["moe-w4a16-4-experts"], "reload_keeps_identity"),
        _a2a("a2a-prefill-returns-flashinfer-combine-w4a4", _prefill_returns_flashinfer_combine,
             "moe-w4a4-flashinfer-a2a-prefill", "standard_combine"),
        _a2a("a2a-prefill-returns-flashinfer-combine-w4a16", _prefill_returns_flashinfer_combine,
             "moe-w4a16-flashinfer-a2a-prefill", "standard_combine"),
        _a2a("a2a-decode-scale-as-encode-scale-w4a4", _decode_scale_as_encode_scale, "moe-w4a4-flashinfer-a2a-prefill",
             "activations"),
        _a2a("a2a-w4a16-wrapper-built-as-w4a4-activations", _w4a16_wrapper_built_as_w4a4,
             "moe-w4a16-flashinfer-a2a-prefill", "activations"),
        _a2a("a2a-w4a16-wrapper-built-as-w4a4-output", _w4a16_wrapper_built_as_w4a4, "moe-w4a16-flashinfer-a2a-prefill",
             "output_within_bound"),
    ],
    "vllm": [
        EngineMutant("w4a16-alpha-from-first-shard", _alpha_from_first_shard, _CASES["dense-w4a16-fused-qkv"],
                     "output_within_bound"),
        EngineMutant("w4a16-alpha-reciprocal", _alpha_reciprocal, _CASES["dense-w4a16-plain"], "output_within_bound"),
        EngineMutant("w4a16-scales-not-swizzled", _scales_not_swizzled, _FULL_TILES, "output_within_bound"),
        EngineMutant("w4a16-scales-not-swizzled-partial-tile", _scales_not_swizzled, _CASES["dense-w4a16-plain"],
                     "output_within_bound"),
        EngineMutant("w4a16-reload-rebinds", _vllm_reload_rebinds, _CASES["dense-w4a16-plain"], "reload_keeps_identity"),
    ],
}

#: engine -> the controls: cases of its mutants the unpatched engine must pass with no failing check (the
#: same-size swizzle mutants would otherwise prove nothing)
CONTROLS: dict[str, list] = {
    "sglang": [_FULL_TILES],
    "vllm": [_FULL_TILES, _CASES["dense-w4a16-fused-qkv"]],
}
