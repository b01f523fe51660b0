"""The reference rules engine: reference_impl's pure functions, under a rules profile (``use_profile``)."""
from __future__ import annotations

from typing import Any

import torch

from reference_impl.rules import sglang_paths as P
from reference_impl.rules import sglang as R
from reference_impl.rules import lm_head as L
from reference_impl.rules import reload as RL
from reference_impl.rules import vllm as V

from conformance.interfaces.rules import Inputs, RulesEngine


def _unwrap_early(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except R.RejectedEarlier as early:
        raise early.error from None


class ReferenceRules(RulesEngine):
    name = "reference"

    def __init__(self, profile: str = R.DEFAULT_PROFILE) -> None:
        self.profile = _checked(profile)  # not through use_profile: a subclass may pin its profile there

    def use_profile(self, profile: str) -> None:
        self.profile = _checked(profile)

    def version(self) -> str:
        return f"reference_impl, rules profile {self.profile}"

    def resolve_dense(self, inputs: Inputs) -> dict[str, Any]:
        backend = R.resolve_fp4_gemm_backend(inputs["fp4_backend"], inputs["platform"], self.profile)
        method, mode = R.dense_linear_method(inputs["quant_algo"], inputs["w4a16"], backend)
        return {"linear_method": method, "quant_mode": mode}

    def fp4_gemm_dispatch(self, inputs: Inputs) -> dict[str, Any]:
        kernel, backend = R.fp4_gemm_kernel(inputs["quant_mode"], inputs["fp4_backend"])
        return {"kernel": kernel, "flashinfer_backend": backend}

    def resolve_moe(self, inputs: Inputs) -> dict[str, Any]:
        return {"quant_mode": _unwrap_early(R.moe_quant_mode, env_w4a16=inputs["w4a16"], runner=inputs["runner"],
                                            a2a=inputs["a2a"], deepep_mode=inputs["deepep_mode"],
                                            profile=self.profile)}

    def validate_a2a(self, inputs: Inputs) -> dict[str, Any]:
        return {"dispatch": _unwrap_early(
            R.a2a_dispatch_dtype, env_w4a16=inputs["w4a16"], nvfp4_dispatch_env=inputs["nvfp4_dispatch"],
            dispatch_type=inputs["dispatch_type"], a2a=inputs["a2a"], runner=inputs["runner"],
            quantization=inputs["quantization"])}

    def fusion_enabled(self, inputs: Inputs) -> dict[str, Any]:
        gate_up = inputs["gate_up"]
        method = "UnquantizedLinearMethod" if gate_up == "unquantized" else "ModelOptFp4LinearMethod"
        mode = None if gate_up == "unquantized" else gate_up.removeprefix("nvfp4_")
        return {"enabled": R.fusion_enabled(model=inputs["model"], gate_up_method=method, quant_mode=mode,
                                            fp4_backend=inputs["fp4_backend"])}

    def lm_head_guard(self, method, quant_mode, weight_dtype, attrs) -> bool:
        return L.should_apply_lm_head_quant_method(method, quant_mode, weight_dtype, attrs)

    def reload_param(self, module: torch.nn.Module, name: str, new_value: torch.Tensor, *, graph_captured: bool) -> None:
        RL.copy_or_rebind_param(module, name, new_value, graph_captured=graph_captured)

    # ---- optional methods ----------------------------------------------------------------------------------

    def fp4_gemm_backend(self, inputs: Inputs) -> dict[str, Any]:
        return {"backend": R.resolve_fp4_gemm_backend(inputs["fp4_backend"], inputs["platform"], self.profile)}

    def moe_activation(self, inputs: Inputs) -> dict[str, Any]:
        return P.cutedsl_moe_activation(quantization=inputs["quantization"], env_w4a16=inputs["w4a16"],
                                        env_per_token=inputs["per_token"], dispatch=inputs["dispatch"])

    def fp4_dispatch(self, inputs: Inputs) -> dict[str, Any]:
        return {"dispatch_fp4": P.fp4_dispatch(
            runner=inputs["runner"], a2a=inputs["a2a"], env_w4a16=inputs["w4a16"],
            nvfp4_dispatch=inputs["nvfp4_dispatch"], dp_attention=inputs["dp_attention"], per_token=inputs["per_token"])}

    def bind_derived_param(self, module, source_name, derived_name, value) -> None:
        RL.alias_or_bind_derived_param(module, source_name, derived_name, value)

    def quant_method(self, config_json, hf_quant_config) -> dict[str, Any]:
        return P.quant_method_from_hf(config_json=config_json, hf_quant_config=hf_quant_config)

    def mixed_layer(self, quantized_layers, packed, kind, prefix, name_mapping=None) -> dict[str, Any]:
        layers = dict(quantized_layers)
        for old, new in (name_mapping or {}).items():
            layers = {(new + k.removeprefix(old) if k.startswith(old) else k): v for k, v in layers.items()}
        algo = P.mixed_quant_algo(layers, packed, prefix)
        return {"quant_algo": algo, "method": P.mixed_layer_method(kind, algo)}

    # ---- vLLM's decisions (rules profile vllm-0.32) ----------------------------------------------------------

    def vllm_linear_kernel(self, inputs: Inputs) -> dict[str, Any]:
        return V.linear_kernel(inputs["platform"], inputs["linear_backend"], inputs["batch_invariant"], inputs["humming"])

    def vllm_moe_backend(self, inputs: Inputs) -> dict[str, Any]:
        return V.moe_backend(inputs["platform"], inputs["moe_backend"], inputs["humming"])


def _checked(profile: str) -> str:
    # vLLM's profile models only its own matrices (answered above); the SGLang rules take SGLang profiles
    return profile if profile == V.PROFILE else R.check_profile(profile)
