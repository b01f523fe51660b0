"""Deliberately broken rules engines: each re-plants one rule bug (the first three are the upstream review
findings). tests/rules/test_rule_mutants.py asserts the matrices reject each one, naming a case that catches it."""
from __future__ import annotations

import torch

from reference_impl.rules import sglang_paths as P
from reference_impl.rules import sglang as R
from reference_impl.rules import lm_head as L
from reference_impl.rules import reload as RL

from conformance.adapters.reference.rules import ReferenceRules


class QwenFusionGuardMissing(ReferenceRules):
    """Review bug: qwen3_5's SiLU+FP4-quant fusion guard lacks the `quant_mode == "w4a4"` clause."""

    name = "mutant-qwen-fusion-guard-missing"

    def fusion_enabled(self, inputs):
        if inputs["model"] == "qwen3_5":
            return {"enabled": inputs["gate_up"] != "unquantized"}
        return super().fusion_enabled(inputs)


class DispatchAutoEnabledUnderW4A16(ReferenceRules):
    """Review bug: FlashInfer A2A auto-enables NVFP4 dispatch when the env is unset, even under W4A16."""

    name = "mutant-dispatch-auto-enabled-under-w4a16"

    def validate_a2a(self, inputs):
        out = super().validate_a2a(inputs)
        if (inputs["a2a"] == "flashinfer" and inputs["nvfp4_dispatch"] == "unset" and inputs["dispatch_type"] == "none"
                and inputs["quantization"] == "modelopt_fp4"):
            return {"dispatch": "nvfp4"}
        return out


class LmHeadW4A16BranchMissing(ReferenceRules):
    """Review bug: the LM-head guard has no W4A16 branch, so a W4A16 head is judged by the W4A4 rule."""

    name = "mutant-lm-head-w4a16-branch-missing"

    def lm_head_guard(self, method, quant_mode, weight_dtype, attrs):
        mode = "w4a4" if method == "ModelOptFp4LinearMethod" else quant_mode
        return L.should_apply_lm_head_quant_method(method, mode, weight_dtype, attrs)


class LmHeadRequiresInputScaleInv(ReferenceRules):
    """The W4A16 branch exists but also demands `input_scale_inv`, which a W4A16 head never has."""

    name = "mutant-lm-head-w4a16-requires-input-scale-inv"

    def lm_head_guard(self, method, quant_mode, weight_dtype, attrs):
        verdict = super().lm_head_guard(method, quant_mode, weight_dtype, attrs)
        if method == "ModelOptFp4LinearMethod" and quant_mode == "w4a16":
            return verdict and "input_scale_inv" in attrs
        return verdict


class DenseIgnoresBackend(ReferenceRules):
    """Dense quant_mode follows the env flag alone, ignoring the FP4 GEMM backend."""

    name = "mutant-dense-ignores-backend"

    def resolve_dense(self, inputs):
        out = super().resolve_dense(inputs)
        if out["quant_mode"] is not None:
            out["quant_mode"] = "w4a16" if R.env_true(inputs["w4a16"]) else "w4a4"
        return out


class DeepEPAllowedUnderW4A16(ReferenceRules):
    """DeepEP (CuTe DSL v1 masked path) accepted under W4A16 instead of rejected."""

    name = "mutant-deepep-allowed-under-w4a16"

    def resolve_moe(self, inputs):
        if inputs["a2a"] == "deepep" and inputs["runner"] == "flashinfer_cutedsl" and R.env_true(inputs["w4a16"]):
            R.resolve_deepep_mode(inputs["runner"], inputs["deepep_mode"])  # keep the unrelated rejection
            return {"quant_mode": "w4a16"}
        return super().resolve_moe(inputs)


class ReloadRebindsSameShape(ReferenceRules):
    """Reload rebinds even same-shape tensors: CUDA graphs keep reading the freed storage."""

    name = "mutant-reload-rebinds-same-shape"

    def reload_param(self, module, name, new_value, *, graph_captured):
        current = getattr(module, name, None)
        if current is not None and not graph_captured:
            current.data = new_value.detach().clone()
            current.requires_grad_(False)
            return
        super().reload_param(module, name, new_value, graph_captured=graph_captured)


class DeepseekFusionGuardMissing(ReferenceRules):
    """DeepSeek GEMM+SwiGLU fusion guard without the `quant_mode == "w4a4"` clause."""

    name = "mutant-deepseek-fusion-guard-missing"

    def fusion_enabled(self, inputs):
        if inputs["model"] == "deepseek_v2" and inputs["gate_up"] == "nvfp4_w4a16":
            return {"enabled": inputs["fp4_backend"] not in ("marlin", "flashinfer_trtllm")}
        return super().fusion_enabled(inputs)


class CopiesByIndexing(ReferenceRules):
    """Correct but different: same-shape reload writes with slice assignment instead of copy_()."""

    name = "variant-copies-by-indexing"

    def reload_param(self, module, name, new_value, *, graph_captured):
        current = getattr(module, name, None)
        if (isinstance(current, torch.nn.Parameter) and current.shape == new_value.shape
                and current.dtype == new_value.dtype):
            current.data[...] = new_value.detach()
            return
        super().reload_param(module, name, new_value, graph_captured=graph_captured)


class ReloadWithoutRecaptureGuard(ReferenceRules):
    """Reload rebinds captured state silently (what 0.5.23's copy_or_rebind_param alone does): captured CUDA
    graphs keep reading the old storage."""

    name = "mutant-reload-without-recapture-guard"

    def reload_param(self, module, name, new_value, *, graph_captured):
        super().reload_param(module, name, new_value, graph_captured=False)


class AutoBackendIgnoresPlatform(ReferenceRules):
    """``--fp4-gemm-backend auto`` resolves to flashinfer_cutedsl on every platform."""

    name = "mutant-auto-backend-ignores-platform"

    def fp4_gemm_backend(self, inputs):
        if inputs["fp4_backend"] == "auto":
            return {"backend": "flashinfer_cutedsl"}
        return super().fp4_gemm_backend(inputs)


class Sm12xAutoKeepsCutlassOnMain(ReferenceRules):
    """Judged by sglang-main: SM120/SM121 ``auto`` still picks flashinfer_cutlass (the 0.5.23 rule)."""

    name = "mutant-sm12x-auto-keeps-cutlass"

    def fp4_gemm_backend(self, inputs):
        return {"backend": R.resolve_fp4_gemm_backend(inputs["fp4_backend"], inputs["platform"], R.DEFAULT_PROFILE)}


class DeepEPNormalRejectedOnMain(ReferenceRules):
    """Judged by sglang-main: DeepEP normal + flashinfer_cutedsl + W4A16 still rejected (the 0.5.23 rule)."""

    name = "mutant-deepep-normal-rejected-on-main"

    def resolve_moe(self, inputs):
        saved, self.profile = self.profile, R.DEFAULT_PROFILE
        try:
            return super().resolve_moe(inputs)
        finally:
            self.profile = saved


class PerTokenNotForcedOffUnderW4A16(ReferenceRules):
    """W4A16 keeps per-token activation on (nvfp4_online): the runner quantizes BF16 activations per token."""

    name = "mutant-per-token-not-forced-off-under-w4a16"

    def moe_activation(self, inputs):
        out = super().moe_activation(inputs)
        if inputs["quantization"] == "nvfp4_online" and out["activations"] == "bf16":
            out.update(activations="nvfp4_per_token", x_sf=True, per_token_scale=True)
        return out


class W4A16QuantizesActivations(ReferenceRules):
    """The runner quantizes activations statically under W4A16 (the W4A4 branch taken for every mode)."""

    name = "mutant-w4a16-quantizes-activations"

    def moe_activation(self, inputs):
        out = super().moe_activation(inputs)
        if out["activations"] == "bf16":
            out.update(activations="nvfp4_static", x_sf=True)
        return out


class PrefillReturnsFlashInferCombine(ReferenceRules):
    """FlashInfer-A2A eager prefill returns a FlashInfer combine input: the dispatcher cannot reduce-scatter it."""

    name = "mutant-prefill-returns-flashinfer-combine"

    def moe_activation(self, inputs):
        out = super().moe_activation(inputs)
        if inputs["dispatch"] == "flashinfer_prefill":
            out["combine"] = "flashinfer"
        return out


class Fp4DispatchUnderW4A16(ReferenceRules):
    """The FP4 dispatch decision ignores W4A16: NVFP4 activations reach a BF16-activation kernel."""

    name = "mutant-fp4-dispatch-under-w4a16"

    def fp4_dispatch(self, inputs):
        return super().fp4_dispatch({**inputs, "w4a16": "0"})


class Fp4AllGatherForEveryRunner(ReferenceRules):
    """The FP4 all-gather applies to every runner with DP attention, not only flashinfer_cutlass (0.5.23)."""

    name = "mutant-fp4-allgather-for-every-runner"

    def fp4_dispatch(self, inputs):
        out = super().fp4_dispatch(inputs)
        if (inputs["a2a"] == "none" and inputs["dp_attention"] == "on" and inputs["per_token"] == "0"
                and not (inputs["runner"] == "flashinfer_cutedsl" and R.env_true(inputs["w4a16"]))):
            return {"dispatch_fp4": True}
        return out


class DerivedNeverAliases(ReferenceRules):
    """Derived tensors always get their own Parameter: twice the memory, and a reload refilling the source
    leaves the derived copy stale."""

    name = "mutant-derived-never-aliases"

    def bind_derived_param(self, module, source_name, derived_name, value):
        RL.copy_or_rebind_param(module, derived_name, value)


class DerivedAliasIgnoresDtype(ReferenceRules):
    """Aliases a derived value into a source of another dtype (casting it on the way)."""

    name = "mutant-derived-alias-ignores-dtype"

    def bind_derived_param(self, module, source_name, derived_name, value):
        source = getattr(module, source_name, None)
        if isinstance(source, torch.nn.Parameter):
            value = value.to(source.dtype)
        super().bind_derived_param(module, source_name, derived_name, value)


class DerivedFallbackReplaces(ReferenceRules):
    """The fallback binds a fresh Parameter instead of copying into the one a previous load left."""

    name = "mutant-derived-fallback-replaces"

    def bind_derived_param(self, module, source_name, derived_name, value):
        source = getattr(module, source_name, None)
        if not (isinstance(source, torch.nn.Parameter) and source.dtype == value.dtype and _broadcasts(value, source)):
            setattr(module, derived_name, torch.nn.Parameter(value.detach().clone(), requires_grad=False))
            return
        super().bind_derived_param(module, source_name, derived_name, value)


def _broadcasts(value: torch.Tensor, target: torch.Tensor) -> bool:
    try:
        torch.broadcast_to(value, target.shape)
    except RuntimeError:
        return False
    return True


class AwqNotModelOptFp4(ReferenceRules):
    """Only the exact NVFP4 algo selects the ModelOpt FP4 method (NVFP4_AWQ / FP4 / W4A16_NVFP4 fall through)."""

    name = "mutant-awq-not-modelopt-fp4"

    def quant_method(self, config_json, hf_quant_config):
        out = super().quant_method(config_json, hf_quant_config)
        source = config_json if config_json is not None else (hf_quant_config or {}).get("quantization", {})
        if out["quant_method"] == "modelopt_fp4" and source.get("quant_algo") != "NVFP4":
            return {"quant_method": None, "config_class": None, "fp4_format": None, "group_size": None}
        return out


class MixedW4A16NotMixed(ReferenceRules):
    """A MIXED_PRECISION checkpoint counts only NVFP4 layers: one whose FP4 layers are all W4A16_NVFP4 is sent
    to the w4afp8 method."""

    name = "mutant-mixed-w4a16-not-mixed"

    def quant_method(self, config_json, hf_quant_config):
        out = super().quant_method(config_json, hf_quant_config)
        section = config_json if config_json is not None else (hf_quant_config or {}).get("quantization", {})
        layers = section.get("quantized_layers") or {}
        if out["quant_method"] == "modelopt_mixed" and not any(i.get("quant_algo") == "NVFP4" for i in layers.values()):
            return {**out, "quant_method": "w4afp8", "config_class": P.CONFIG_CLASSES["w4afp8"]}
        return out


class LmHeadNotResolvedInMixed(ReferenceRules):
    """The LM head of a MIXED_PRECISION checkpoint stays unquantized (its entry is never looked up)."""

    name = "mutant-lm-head-not-resolved-in-mixed"

    def mixed_layer(self, quantized_layers, packed, kind, prefix, name_mapping=None):
        if kind == "lm_head":
            return {"quant_algo": None, "method": "UnquantizedLinearMethod"}
        return super().mixed_layer(quantized_layers, packed, kind, prefix, name_mapping)


class RuntimeNamesNotMapped(ReferenceRules):
    """Per-module formats looked up only under the runtime name: a VL checkpoint's model.language_model.* keys
    are never found for the model.* modules the runtime builds."""

    name = "mutant-runtime-names-not-mapped"

    def mixed_layer(self, quantized_layers, packed, kind, prefix, name_mapping=None):
        if prefix in quantized_layers:
            algo = str(quantized_layers[prefix]["quant_algo"]).upper()
        else:
            base, _, proj = prefix.rpartition(".")
            algos = {str(quantized_layers[f"{base}.{s}"]["quant_algo"]).upper() for s in packed.get(proj, ())
                     if f"{base}.{s}" in quantized_layers}
            algo = algos.pop() if len(algos) == 1 else next(
                (str(v["quant_algo"]).upper() for k, v in quantized_layers.items() if k.startswith(prefix + ".")), None)
        return {"quant_algo": algo, "method": P.mixed_layer_method(kind, algo)}


class W4A16LayerAsW4A4Method(ReferenceRules):
    """A W4A16_NVFP4 linear layer of a MIXED_PRECISION checkpoint gets the W4A4 ModelOptFp4LinearMethod."""

    name = "mutant-w4a16-layer-as-w4a4-method"

    def mixed_layer(self, quantized_layers, packed, kind, prefix, name_mapping=None):
        out = super().mixed_layer(quantized_layers, packed, kind, prefix, name_mapping)
        if out["method"] == "ModelOptNvFp4A16LinearMethod":
            out["method"] = "ModelOptFp4LinearMethod"
        return out


# mutant -> (matrix that must catch it, one case id that does)
MUTANTS = {
    QwenFusionGuardMissing: ("fusion", "qwen3_5-nvfp4_w4a16-flashinfer_cutedsl"),
    DispatchAutoEnabledUnderW4A16: ("a2a", "flashinfer-w4a16=1-nvfp4_dispatch=unset-type=none-flashinfer_cutedsl-modelopt_fp4"),
    LmHeadW4A16BranchMissing: ("lm_head", "method=nvfp4_w4a16-head=nvfp4_w4a16"),
    LmHeadRequiresInputScaleInv: ("lm_head", "method=nvfp4_w4a16-head=nvfp4_w4a16"),
    DenseIgnoresBackend: ("dense", "w4a16=1-flashinfer_cutlass-cpu-NVFP4"),
    DeepEPAllowedUnderW4A16: ("moe", "deepep-low_latency-flashinfer_cutedsl-w4a16=1"),
    ReloadRebindsSameShape: ("reload", "parameter-new=same-captured=no"),
    DeepseekFusionGuardMissing: ("fusion", "deepseek_v2-nvfp4_w4a16-flashinfer_cutedsl"),
    ReloadWithoutRecaptureGuard: ("reload", "parameter-new=shape-captured=yes"),
    AutoBackendIgnoresPlatform: ("fp4_backend", "auto-sm90"),
    PerTokenNotForcedOffUnderW4A16: ("moe_activation", "nvfp4_online-w4a16=1-per_token=0-none"),
    W4A16QuantizesActivations: ("moe_activation", "modelopt_fp4-w4a16=1-per_token=0-flashinfer_prefill"),
    PrefillReturnsFlashInferCombine: ("moe_activation", "modelopt_fp4-w4a16=0-per_token=0-flashinfer_prefill"),
    Fp4DispatchUnderW4A16: ("fp4_dispatch", "runner=flashinfer_cutedsl-a2a=flashinfer-w4a16=1-nvfp4_dispatch=1-dp_attention=off-per_token=0"),
    Fp4AllGatherForEveryRunner: ("fp4_dispatch", "runner=flashinfer_trtllm-a2a=none-w4a16=0-nvfp4_dispatch=0-dp_attention=on-per_token=0"),
    DerivedNeverAliases: ("derived_param", "parameter-broadcast_row-before=absent"),
    DerivedAliasIgnoresDtype: ("derived_param", "parameter_other_dtype-broadcast_row-before=absent"),
    DerivedFallbackReplaces: ("derived_param", "parameter-incompatible-before=bound"),
    AwqNotModelOptFp4: ("quant_method", "NVFP4_AWQ-config_json_bare"),
    MixedW4A16NotMixed: ("quant_method", "MIXED_PRECISION_W4A16-hf_quant_config"),
    LmHeadNotResolvedInMixed: ("mixed_layers", "vl-W4A16_NVFP4-lm_head"),
    RuntimeNamesNotMapped: ("mixed_layers", "vl-W4A16_NVFP4-shared_gate_up_proj"),
    W4A16LayerAsW4A4Method: ("mixed_layers", "text-W4A16_NVFP4-shared_gate_up_proj"),
}
# Mutants of a rule that changed upstream: judged by the profile they break (mutant -> (profile, matrix, case)).
PROFILE_MUTANTS = {
    Sm12xAutoKeepsCutlassOnMain: ("sglang-main", "fp4_backend", "auto-sm120"),
    DeepEPNormalRejectedOnMain: ("sglang-main", "moe", "deepep-normal-flashinfer_cutedsl-w4a16=1"),
}
ACCEPTED_VARIANTS = (CopiesByIndexing,)
