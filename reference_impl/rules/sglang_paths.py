"""More SGLang NVFP4 rules, as small pure functions: the CuTe DSL MoE runner's activation path (serialized
``modelopt_fp4`` and online ``nvfp4_online`` experts), the FP4 all-gather / dispatch decision, which
quantization method a checkpoint's Hugging Face config selects, and how a ModelOpt MIXED_PRECISION
checkpoint resolves each runtime module's format.

Written from docs/contracts.md section 4 and the SGLang 0.5.23 code it points to (``CODE:`` marks a point that
the code decides and the contract (docs/contracts.md) does not state). Same conventions as :mod:`reference_impl.rules.sglang`.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from reference_impl.rules.sglang import env_true

# ---- CuTe DSL MoE runner: what the activations look like when they reach the kernel ----------------------

MOE_QUANTIZATIONS = ("modelopt_fp4", "nvfp4_online")
# none: no A2A; flashinfer_prefill: FlashInfer A2A, eager prefill (an all-gather hands a standard
# dispatch output over); flashinfer_decode_bf16 / _nvfp4: FlashInfer A2A dispatch with BF16 / NVFP4 payload.
MOE_DISPATCH_KINDS = ("none", "flashinfer_prefill", "flashinfer_decode_bf16", "flashinfer_decode_nvfp4")
ACTIVATION_KINDS = ("bf16", "nvfp4_static", "nvfp4_per_token", "nvfp4_dispatched")


class NotReachable(ValueError):
    """The combination never reaches this rule: an earlier rule (named in the message) rejects it."""


def cutedsl_moe_activation(*, quantization: str, env_w4a16: str, env_per_token: str, dispatch: str) -> dict[str, Any]:
    """How the flashinfer_cutedsl standard-path runner hands activations to ``CuteDslMoEWrapper.run``.

    docs/contracts.md sections 3 and 4: under W4A16 the activations stay BF16 (no quantization, ``x_sf``, ``per_token_scale`` and
    ``fc2_input_scale`` all None) on every dispatch kind. Per-token activation is a property of the quant
    config (``nvfp4_online`` always; ``modelopt_fp4`` with SGLANG_FLASHINFER_NVFP4_PER_TOKEN_ACTIVATION) and
    is forced off under W4A16 (CODE: ``apply`` passes ``use_per_token_activation and quant_mode == "w4a4"``).
    Under W4A4 the runner quantizes (per token with ``nvfp4_quantize``, else statically with
    ``fp4_quantize``) unless the dispatcher already sent NVFP4 (pass-through; per-token then raises
    ValueError, CODE). The eager FlashInfer-A2A prefill path returns a *standard* combine input (the
    dispatcher reduce-scatters it); the A2A dispatch path returns a FlashInfer combine input."""
    if quantization not in MOE_QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {MOE_QUANTIZATIONS}, got {quantization!r}")
    if dispatch not in MOE_DISPATCH_KINDS:
        raise ValueError(f"dispatch must be one of {MOE_DISPATCH_KINDS}, got {dispatch!r}")
    w4a16 = env_true(env_w4a16)
    config_per_token = quantization == "nvfp4_online" or env_true(env_per_token)
    per_token = config_per_token and not w4a16
    combine = "standard" if dispatch in ("none", "flashinfer_prefill") else "flashinfer"

    def path(activations: str) -> dict[str, Any]:
        quantized = activations != "bf16"
        return {"activations": activations, "x_sf": quantized, "per_token_scale": activations == "nvfp4_per_token",
                "fc2_input_scale": not w4a16, "combine": combine}

    if dispatch == "flashinfer_decode_nvfp4":
        if w4a16:
            raise NotReachable("W4A16 never dispatches NVFP4 activations (a2a rules reject it)")
        if per_token:
            raise ValueError("flashinfer_cutedsl per-token activation requires BF16 dispatch")
        return path("nvfp4_dispatched")
    if w4a16:
        return path("bf16")
    return path("nvfp4_per_token" if per_token else "nvfp4_static")


# ---- FP4 all-gather / dispatch: does the dispatcher quantize activations before sending them? ------------

FP4_DISPATCH_RUNNERS = ("flashinfer_cutedsl", "flashinfer_cutlass", "flashinfer_trtllm")
FP4_DISPATCH_A2A = ("none", "flashinfer")


def fp4_dispatch(*, runner: str, a2a: str, env_w4a16: str, nvfp4_dispatch: str, dp_attention: str,
                 per_token: str) -> bool:
    """Whether the NVFP4 MoE layer gives its dispatcher the activation global scale, i.e. the tokens travel
    as NVFP4 (``use_dispatch_fp4`` in ``process_weights_after_loading``).

    docs/contracts.md section 4: never under W4A16 (the activations must stay BF16 end to end) and never with per-token
    activation (the scale is per token, computed by FlashInfer). Otherwise when NVFP4 dispatch is on
    (``nvfp4_dispatch``: the resolved SGLANG_MOE_NVFP4_DISPATCH / --flashinfer-a2a-dispatch-type) or the FP4
    all-gather applies: CODE (0.5.23) only the flashinfer_cutlass runner, no A2A, DP attention with
    ``ep_size == attn_dp_size``, modelopt_fp4, all-gather not disabled (the cases hold the last three)."""
    if runner not in FP4_DISPATCH_RUNNERS or a2a not in FP4_DISPATCH_A2A:
        raise ValueError(f"runner/a2a out of range: {runner!r}, {a2a!r}")
    w4a16 = runner == "flashinfer_cutedsl" and env_true(env_w4a16)  # the CuTe DSL standard path is W4A16-capable
    allgather = runner == "flashinfer_cutlass" and a2a == "none" and dp_attention == "on"
    return not env_true(per_token) and not w4a16 and (env_true(nvfp4_dispatch) or allgather)


# ---- quantization method from a checkpoint's Hugging Face config ------------------------------------------

CONFIG_CLASSES = {
    "modelopt_fp4": "ModelOptFp4Config", "modelopt_fp8": "ModelOptFp8Config",
    "modelopt_mixed": "ModelOptMixedPrecisionConfig", "w4afp8": "W4AFp8Config", "mxfp8": "Fp8Config",
}
FP4_CONFIG_ALGOS = ("FP8", "NVFP4", "NVFP4_AWQ", "W4A16_NVFP4")  # what ModelOptFp4Config.from_config accepts
NVFP4_LAYER_ALGOS = ("NVFP4", "W4A16_NVFP4")


def _modelopt_section(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """``{"quantization": {...}}`` (hf_quant_config.json, possibly nested twice) or the flat form."""
    section = config.get("quantization", config)
    if not isinstance(section, Mapping):
        return {}
    inner = section.get("quantization")
    return inner if isinstance(inner, Mapping) else section


def modelopt_quant_method(config: Mapping[str, Any]) -> str | None:
    """The method a ModelOpt quant config selects, from its ``quant_algo``. CODE: MIXED_PRECISION is the
    mixed method only when a layer is NVFP4 or W4A16_NVFP4 (else w4afp8); any algo containing FP4 (NVFP4,
    NVFP4_AWQ, FP4, W4A16_NVFP4) -> modelopt_fp4."""
    section = _modelopt_section(config)
    algo = section.get("quant_algo")
    if not algo:
        return None
    if algo == "MIXED_PRECISION":
        layers = section.get("quantized_layers") or {}
        nvfp4 = any(isinstance(i, Mapping) and str(i.get("quant_algo", "")).upper() in NVFP4_LAYER_ALGOS
                    for i in layers.values())
        return "modelopt_mixed" if nvfp4 else "w4afp8"
    if "FP4" in algo:
        return "modelopt_fp4"
    return {"FP8": "modelopt_fp8", "MXFP8": "mxfp8"}.get(algo)


def _fp4_format(config: Mapping[str, Any]) -> tuple[str, int | None]:
    """(format, group_size) the ModelOpt FP4 config takes from the checkpoint; format ``rejected`` when its
    loader refuses the algo (CODE: it accepts FP8/NVFP4/NVFP4_AWQ/W4A16_NVFP4 only, so a plain ``FP4``
    algo is *selected* as modelopt_fp4 but then refused). NVFP4 algos default to group size 16."""
    flat = config.get("quant_algo") is not None
    section = config if flat else config.get("quantization", {})
    algo = section.get("quant_algo")
    if algo not in FP4_CONFIG_ALGOS:
        return "rejected", None
    group = section.get("group_size")
    if group is None and "NVFP4" in algo:
        group = 16
    return algo, group


def quant_method_from_hf(*, config_json: Mapping[str, Any] | None,
                         hf_quant_config: Mapping[str, Any] | None) -> dict[str, Any]:
    """What a checkpoint's ``config.json`` ``quantization_config`` (checked first) or its standalone
    ``hf_quant_config.json`` selects: the method name, its config class, and for modelopt_fp4 the
    checkpoint format and group size. A config.json method other than ``modelopt`` is kept as is."""
    method: str | None = None
    source: Mapping[str, Any] | None = None
    if config_json is not None:
        declared = config_json.get("quant_method")
        method = declared
        if declared is None or declared == "modelopt":
            method = modelopt_quant_method({"quantization": config_json}) or declared
        source = config_json
    elif hf_quant_config is not None:
        method, source = modelopt_quant_method(hf_quant_config), hf_quant_config
    fmt, group = _fp4_format(source) if (method == "modelopt_fp4" and source is not None) else (None, None)
    return {"quant_method": method, "config_class": CONFIG_CLASSES.get(method or ""), "fp4_format": fmt,
            "group_size": group}


# ---- MIXED_PRECISION: each runtime module's format ---------------------------------------------------------

LAYER_KINDS = ("linear", "lm_head", "moe")
_BLOCK_FP8 = ("FP8_PB_WO", "FP8_BLOCK_SCALES")
_LINEAR_METHODS = {"FP8": "ModelOptFp8LinearMethod", "MXFP8": "Fp8LinearMethod", "NVFP4": "ModelOptFp4LinearMethod",
                   "W4A16_NVFP4": "ModelOptNvFp4A16LinearMethod", **{a: "Fp8LinearMethod" for a in _BLOCK_FP8}}
_MOE_METHODS = {"FP8": "ModelOptFp8MoEMethod", "MXFP8": "Fp8MoEMethod", "NVFP4": "ModelOptNvFp4FusedMoEMethod",
                "W4A16_NVFP4": "ModelOptNvFp4FusedMoEMethod", **{a: "Fp8MoEMethod" for a in _BLOCK_FP8}}


def _name_candidates(prefix: str) -> list[str]:
    """The checkpoint names a runtime module may be keyed under. CODE: ``*.lm_head`` also as ``lm_head``;
    VL checkpoints key the text stack ``model.language_model.*`` while runtimes name it ``model.*`` (and
    some ``language_model.model.*``)."""
    out = [prefix]
    if prefix.endswith(".lm_head"):
        out.append("lm_head")
    if prefix.startswith("language_model.model."):
        out.append("model.language_model." + prefix.removeprefix("language_model.model."))
    elif prefix.startswith("model.language_model."):
        rest = prefix.removeprefix("model.language_model.")
        out += ["language_model.model." + rest, "model." + rest]
    elif prefix.startswith("model."):
        out.append("model.language_model." + prefix.removeprefix("model."))
    return list(dict.fromkeys(out))


def mixed_quant_algo(quantized_layers: Mapping[str, Mapping[str, Any]], packed: Mapping[str, list[str]],
                     prefix: str) -> str | None:
    """A runtime module's quant_algo in a MIXED_PRECISION checkpoint: its own entry; else, for a fused
    module (``packed``: fused name -> shard names), the shards' common algo (ValueError when they differ);
    else the first entry below it (an experts module resolves from ``experts.<e>.<proj>``)."""
    for name in _name_candidates(prefix):
        if name in quantized_layers:
            return str(quantized_layers[name]["quant_algo"]).upper()
    base, _, proj = prefix.rpartition(".")
    if proj in packed:
        algos = {str(quantized_layers[f"{b}.{shard}"]["quant_algo"]).upper()
                 for b in _name_candidates(base) for shard in packed[proj] if f"{b}.{shard}" in quantized_layers}
        if len(algos) > 1:
            raise ValueError(f"Mixed quant_algo within fused layer {prefix}: {algos}")
        if algos:
            return algos.pop()
    for name in _name_candidates(prefix):
        for key, info in quantized_layers.items():
            if key.startswith(name + "."):
                return str(info["quant_algo"]).upper()
    return None


def mixed_layer_method(kind: str, algo: str | None) -> str | None:
    """The quant method class a MIXED_PRECISION checkpoint gives a module of ``kind`` with ``algo``: linear
    and LM-head modules fall back to UnquantizedLinearMethod, an MoE module to no method (None)."""
    if kind not in LAYER_KINDS:
        raise ValueError(f"kind must be one of {LAYER_KINDS}, got {kind!r}")
    if kind == "moe":
        return _MOE_METHODS.get(algo or "")
    return _LINEAR_METHODS.get(algo or "", "UnquantizedLinearMethod")
