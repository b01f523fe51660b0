"""More broken rules engines, written independently of tests/rules/mutants.py (a red-team pass over issue 16):
each plants one realistic rule bug; tests/rules/test_rule_mutants.py asserts the named case rejects it."""
from __future__ import annotations

import torch
from torch.nn import Parameter

from reference_impl.rules import sglang_paths as P
from reference_impl.rules import sglang as R

from conformance.adapters.reference.rules import ReferenceRules


def _rewrite_env(inputs, key: str, fn) -> dict:
    return {**inputs, key: fn(inputs[key])} if key in inputs else dict(inputs)


class EnvZeroIsTruthy(ReferenceRules):
    """`bool(os.environ.get(NAME))`: any set value, "0" included, enables W4A16."""

    name = "redteam-env-zero-is-truthy"

    def resolve_dense(self, inputs):
        return super().resolve_dense(_rewrite_env(inputs, "w4a16", lambda v: "1" if v != "unset" else v))


class EnvFalseWordIsTruthy(ReferenceRules):
    """`value not in ("", "0")`: the word "false" (or "no") enables W4A16."""

    name = "redteam-env-false-word-is-truthy"

    def resolve_moe(self, inputs):
        return super().resolve_moe(_rewrite_env(inputs, "w4a16", lambda v: "1" if v not in ("unset", "0") else v))


class EnvOnlyDigitOne(ReferenceRules):
    """`value == "1"`: SGLang's other true words ("true", "yes", "y", any case) leave W4A16 off."""

    name = "redteam-env-only-digit-one"

    def resolve_dense(self, inputs):
        return super().resolve_dense(_rewrite_env(inputs, "w4a16", lambda v: v if v in ("unset", "1") else "0"))


class DispatchEnvFalseCountsAsUnset(ReferenceRules):
    """Reads SGLANG_MOE_NVFP4_DISPATCH with get() where SGLang asks is_set(): explicitly "0" is taken as
    unset, so NVFP4 dispatch is auto-enabled and the env/CLI conflict is not reported."""

    name = "redteam-dispatch-env-false-counts-as-unset"

    def validate_a2a(self, inputs):
        return super().validate_a2a(_rewrite_env(inputs, "nvfp4_dispatch", lambda v: "unset" if not R.env_true(v) else v))


class DenseW4A16OnCudnnBackend(ReferenceRules):
    """W4A16 enabled for the cudnn FP4 GEMM backend too (only flashinfer_cutedsl serves it)."""

    name = "redteam-dense-w4a16-on-cudnn"

    def resolve_dense(self, inputs):
        out = super().resolve_dense(inputs)
        backend = R.resolve_fp4_gemm_backend(inputs["fp4_backend"], inputs["platform"], self.profile)
        if out["quant_mode"] == "w4a4" and backend == "flashinfer_cudnn" and R.env_true(inputs["w4a16"]):
            out = dict(out, quant_mode="w4a16")
        return out


class MoeW4A16OnCutlassRunner(ReferenceRules):
    """The MoE W4A16 switch honoured for the flashinfer_cutlass runner (W4A4 only there)."""

    name = "redteam-moe-w4a16-on-cutlass-runner"

    def resolve_moe(self, inputs):
        if inputs["runner"] == "flashinfer_cutlass" and inputs["a2a"] != "deepep" and R.env_true(inputs["w4a16"]):
            return {"quant_mode": "w4a16"}
        return super().resolve_moe(inputs)


class DeepEPModesSwapped(ReferenceRules):
    """DeepEP normal and low-latency confused: the CuTe DSL check rejects low_latency and accepts normal."""

    name = "redteam-deepep-modes-swapped"

    def resolve_moe(self, inputs):
        swap = {"normal": "low_latency", "low_latency": "normal"}
        return super().resolve_moe({**inputs, "deepep_mode": swap.get(inputs["deepep_mode"], inputs["deepep_mode"])})


class A2AAutoAcceptedUnderW4A16(ReferenceRules):
    """`--flashinfer-a2a-dispatch-type auto` accepted under W4A16 (resolved to bf16) instead of rejected."""

    name = "redteam-a2a-auto-accepted-under-w4a16"

    def validate_a2a(self, inputs):
        if (inputs["dispatch_type"] == "auto" and inputs["a2a"] == "flashinfer" and inputs["runner"] == "flashinfer_cutedsl"
                and R.env_true(inputs["w4a16"]) and inputs["nvfp4_dispatch"] == "unset"
                and inputs["quantization"] == "modelopt_fp4"):
            return {"dispatch": "bf16"}
        return super().validate_a2a(inputs)


class LmHeadAlphaNotChecked(ReferenceRules):
    """The W4A16 LM-head guard checks weight_scale_interleaved but not alpha (which apply() reads)."""

    name = "redteam-lm-head-alpha-not-checked"

    def lm_head_guard(self, method, quant_mode, weight_dtype, attrs):
        if method == "ModelOptFp4LinearMethod" and quant_mode == "w4a16":
            return weight_dtype == "uint8" and "weight_scale_interleaved" in attrs
        return super().lm_head_guard(method, quant_mode, weight_dtype, attrs)


class _ReloadCopiesWhenHalfMatches(ReferenceRules):
    """Reload copies the new value into the old parameter's storage whenever :meth:`matches` (one half of the
    dtype-and-shape comparison) holds, instead of rebinding."""

    def matches(self, current: Parameter, new_value: torch.Tensor) -> bool:
        raise NotImplementedError

    def reload_param(self, module, name, new_value, *, graph_captured):
        current = getattr(module, name, None)
        if isinstance(current, Parameter) and self.matches(current, new_value):
            current.data.copy_(new_value.detach())
            return
        super().reload_param(module, name, new_value, graph_captured=graph_captured)


class ReloadCopiesWhenDtypeMatches(_ReloadCopiesWhenHalfMatches):
    """Reload compares dtype only: a reshaped tensor is copied into the old storage (copy_ broadcasts or
    fails) instead of rebinding."""

    name = "redteam-reload-copies-when-dtype-matches"

    def matches(self, current, new_value):
        return current.dtype == new_value.dtype


class ReloadCopiesWhenShapeMatches(_ReloadCopiesWhenHalfMatches):
    """Reload compares shape only: an fp32 reload is cast into the old bf16 storage (silent precision loss)."""

    name = "redteam-reload-copies-when-shape-matches"

    def matches(self, current, new_value):
        return current.shape == new_value.shape


class RecaptureDemandedOnEveryCapturedReload(ReferenceRules):
    """An over-eager guard: any reload under captured graphs asks for a recapture, even an in-place copy."""

    name = "redteam-recapture-on-every-captured-reload"

    def reload_param(self, module, name, new_value, *, graph_captured):
        if graph_captured and isinstance(getattr(module, name, None), Parameter):
            raise RuntimeError(f"{name}: CUDA graph recapture is required")
        super().reload_param(module, name, new_value, graph_captured=graph_captured)


class GemmModeCaseInsensitive(ReferenceRules):
    """The FP4 GEMM op lower-cases its quant mode, so "W4A16" is served instead of raising ValueError."""

    name = "redteam-gemm-mode-case-insensitive"

    def fp4_gemm_dispatch(self, inputs):
        return super().fp4_gemm_dispatch({**inputs, "quant_mode": inputs["quant_mode"].lower()})


class GemmBackendNameWithoutDash(ReferenceRules):
    """flashinfer_cutedsl passed to FlashInfer as "cutedsl" (its API name is "cute-dsl")."""

    name = "redteam-gemm-backend-name-without-dash"

    def fp4_gemm_dispatch(self, inputs):
        out = super().fp4_gemm_dispatch(inputs)
        return dict(out, flashinfer_backend=out["flashinfer_backend"].replace("-", ""))


class Fc2InputScaleUnderW4A16(ReferenceRules):
    """W4A16 keeps BF16 activations for GEMM1 but still hands the kernel the fc2 input scale."""

    name = "redteam-fc2-input-scale-under-w4a16"

    def moe_activation(self, inputs):
        return dict(super().moe_activation(inputs), fc2_input_scale=True)


class FusedShardsFirstWins(ReferenceRules):
    """A fused module whose shards disagree takes the first shard's format instead of raising ValueError."""

    name = "redteam-fused-shards-first-wins"

    def mixed_layer(self, quantized_layers, packed, kind, prefix, name_mapping=None):
        base, _, proj = prefix.rpartition(".")
        for shard in packed.get(proj, ()):
            for key, info in quantized_layers.items():
                if key.endswith(f"{base.removeprefix('model.')}.{shard}"):
                    algo = str(info["quant_algo"]).upper()
                    return {"quant_algo": algo, "method": P.mixed_layer_method(kind, algo)}
        return super().mixed_layer(quantized_layers, packed, kind, prefix, name_mapping)


class W4A16CheckpointReadAsNvfp4(ReferenceRules):
    """A W4A16_NVFP4 checkpoint's format is read as NVFP4 (so its layers would quantize activations)."""

    name = "redteam-w4a16-checkpoint-read-as-nvfp4"

    def quant_method(self, config_json, hf_quant_config):
        out = super().quant_method(config_json, hf_quant_config)
        return dict(out, fp4_format="NVFP4") if out["fp4_format"] == "W4A16_NVFP4" else out


class DerivedAliasWithoutFill(ReferenceRules):
    """Aliases the derived name to the source but forgets to write the derived value into it."""

    name = "redteam-derived-alias-without-fill"

    def bind_derived_param(self, module, source_name, derived_name, value):
        source = getattr(module, source_name, None)
        if isinstance(source, Parameter) and source.dtype == value.dtype:
            try:
                torch.broadcast_to(value, source.shape)
            except RuntimeError:
                pass
            else:
                setattr(module, derived_name, source)
                return
        super().bind_derived_param(module, source_name, derived_name, value)


# mutant -> (matrix that must catch it, one case id that does)
REDTEAM_MUTANTS = {
    EnvZeroIsTruthy: ("env_flags", "w4a16_dense=0"),
    EnvFalseWordIsTruthy: ("env_flags", "w4a16_moe=false"),
    EnvOnlyDigitOne: ("env_flags", "w4a16_dense=true"),
    DispatchEnvFalseCountsAsUnset: ("env_flags", "nvfp4_dispatch=false"),
    DenseW4A16OnCudnnBackend: ("dense", "w4a16=1-flashinfer_cudnn-sm100-NVFP4"),
    MoeW4A16OnCutlassRunner: ("moe", "none-auto-flashinfer_cutlass-w4a16=1"),
    DeepEPModesSwapped: ("moe", "deepep-low_latency-flashinfer_cutedsl-w4a16=unset"),
    A2AAutoAcceptedUnderW4A16: ("a2a", "flashinfer-w4a16=1-nvfp4_dispatch=unset-type=auto-flashinfer_cutedsl-modelopt_fp4"),
    LmHeadAlphaNotChecked: ("lm_head", "method=nvfp4_w4a16-head=nvfp4_w4a16_missing_alpha"),
    ReloadCopiesWhenDtypeMatches: ("reload", "parameter-new=shape-captured=no"),
    ReloadCopiesWhenShapeMatches: ("reload", "parameter-new=dtype-captured=no"),
    RecaptureDemandedOnEveryCapturedReload: ("reload", "parameter-new=same-captured=yes"),
    GemmModeCaseInsensitive: ("fp4_gemm", "mode=W4A16-flashinfer_cutedsl"),
    GemmBackendNameWithoutDash: ("fp4_gemm", "mode=w4a16-flashinfer_cutedsl"),
    Fc2InputScaleUnderW4A16: ("moe_activation", "nvfp4_online-w4a16=1-per_token=1-none"),
    FusedShardsFirstWins: ("mixed_layers", "text-NVFP4-mismatched_gate_up_proj"),
    W4A16CheckpointReadAsNvfp4: ("quant_method", "W4A16_NVFP4-hf_quant_config"),
    DerivedAliasWithoutFill: ("derived_param", "parameter-broadcast_row-before=absent"),
}
