"""Deliberately broken rules engines: each re-plants one rule bug (the first three are the upstream review
findings). tests/test_rule_mutants.py asserts the matrices reject each one, naming a case that catches it."""
from __future__ import annotations

import torch

from reference_impl import config_rules as R
from reference_impl import lm_head as L

from conformance.engines.reference import ReferenceRules


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
}
ACCEPTED_VARIANTS = (CopiesByIndexing,)
