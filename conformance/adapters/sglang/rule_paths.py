"""The ``sglang`` engine's answers for the matrices added with the rule profiles (a mixin of SGLangRules):
SGLang 0.5.23's own code on CPU.

- moe_activation: a real ``ModelOptNvFp4FusedMoEMethod`` (``modelopt_fp4``) or ``ModelOptNvFp4OnlineFusedMoEMethod``
  (``nvfp4_online``) built under the case's flags and environment, its real ``apply`` with the real CuTe DSL
  fused functions chosen by SGLang's ``MoeRunner`` for the A2A backend, and the real ``ensure_cutedsl_wrapper``;
  FlashInfer (GPU only) is replaced by recording stand-ins: the wrapper class, ``nvfp4_quantize`` and
  ``fp4_utils.fp4_quantize``. What the kernel would receive is read from the recorded ``run`` call.
- fp4_dispatch: the ``use_dispatch_fp4 = ...`` statement of ``process_weights_after_loading`` (needs a loaded
  GPU layer), executed from the installed source with SGLang's real ``_use_nvfp4_dispatch`` and
  ``should_use_flashinfer_cutlass_moe_fp4_allgather`` under the case's flags (see
  :mod:`conformance.interfaces.upstream_source`).
- derived_param: ``layers.utils.common.alias_or_bind_derived_param``.
- quant_method: ``ModelConfig._parse_quant_hf_config`` on the checkpoint config (a temporary model directory
  holds hf_quant_config.json), SGLang's quantization registry for the class, ``ModelOptFp4Config.from_config``.
- mixed_layers: ``ModelOptMixedPrecisionConfig.from_config`` + ``apply_weight_name_mapper`` +
  ``get_quant_method`` on real (uninitialised) layer objects.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import types
from typing import Any
from unittest import mock

import torch

from conformance.interfaces.rules import Inputs
from conformance.interfaces import upstream_source as _source
from conformance.adapters.sglang._import import import_sglang_module

_ns = types.SimpleNamespace
_PER_TOKEN_ENV = "SGLANG_FLASHINFER_NVFP4_PER_TOKEN_ACTIVATION"


class _RecordingFlashInfer:
    """Stand-ins for the FlashInfer entry points the CuTe DSL runner uses, recording every call."""

    def __init__(self, hidden: int) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        calls, out_hidden = self.calls, hidden

        class CuteDslMoEWrapper:
            def __init__(self, **kwargs):
                calls.append(("CuteDslMoEWrapper", kwargs))
                self.quant_mode = kwargs["quant_mode"]

            def run(self, **kwargs):
                calls.append(("run", kwargs))
                return torch.zeros(kwargs["x"].shape[0], out_hidden, dtype=torch.bfloat16)

        def quantize(name: str, per_token: bool):
            def fn(x, global_scale, **kwargs):
                calls.append((name, kwargs))
                t, h = x.shape
                packed, sf = torch.zeros(t, h // 2, dtype=torch.uint8), torch.zeros(t, h // 16, dtype=torch.uint8)
                return (packed, sf, torch.ones(t)) if per_token else (packed, sf)
            return fn

        self.fp4_quantize = quantize("fp4_quantize", per_token=False)
        utils = types.ModuleType("flashinfer.quantization.nvfp4_quantization_utils")
        utils.current_nvfp4_4over6_config = lambda: None
        utils.make_nvfp4_global_scale = lambda scale, **kw: scale.reshape(-1).float()
        root = types.ModuleType("flashinfer")
        root.ActivationType = _ns(Swiglu="swiglu", Relu2="relu2")
        root.CuteDslMoEWrapper, root.SfLayout = CuteDslMoEWrapper, _ns(layout_linear=0)
        root.nvfp4_quantize = quantize("nvfp4_quantize", per_token=True)
        self.modules = {"flashinfer": root, "flashinfer.quantization": types.ModuleType("flashinfer.quantization"),
                        "flashinfer.quantization.nvfp4_quantization_utils": utils}

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]


def _activations_seen(fi: _RecordingFlashInfer) -> dict[str, Any]:
    runs = [kw for name, kw in fi.calls if name == "run"]
    if len(runs) != 1:
        raise AssertionError(f"the CuTe DSL wrapper ran {len(runs)} times: {fi.names()}")
    run, names = runs[0], fi.names()
    quantizers = [n for n in ("fp4_quantize", "nvfp4_quantize") if n in names]
    if len(quantizers) > 1:
        raise AssertionError(f"activations quantized twice: {names}")
    if quantizers:
        activations = "nvfp4_static" if quantizers[0] == "fp4_quantize" else "nvfp4_per_token"
    else:
        activations = "bf16" if run["x"].dtype == torch.bfloat16 else "nvfp4_dispatched"
    return {"activations": activations, "x_sf": run["x_sf"] is not None,
            "per_token_scale": run["per_token_scale"] is not None,
            "fc2_input_scale": run["fc2_input_scale"] is not None}


class SGLangPathRules:
    """Mixin: expects ``self.mq``, ``self.fu``, ``self.common``, ``self.moe_utils``, ``self.runtime``,
    ``self._environment`` and ``self._fp4_backend`` from SGLangRules."""

    # ---- CuTe DSL MoE runner ---------------------------------------------------------------------------------

    def moe_activation(self, inputs: Inputs) -> dict[str, Any]:
        m = import_sglang_module
        cutedsl = m("sglang.srt.layers.moe.moe_runner.flashinfer_cutedsl")
        standard = m("sglang.srt.layers.moe.token_dispatcher.standard")
        fi_disp = m("sglang.srt.layers.moe.token_dispatcher.flashinfer")
        topk, base = m("sglang.srt.layers.moe.topk"), m("sglang.srt.layers.moe.moe_runner.base")
        u, rc = self.moe_utils, self.runtime
        dispatch = inputs["dispatch"]
        a2a = u.MoeA2ABackend.NONE if dispatch == "none" else u.MoeA2ABackend.FLASHINFER
        experts, hidden, inter, tokens = 4, 32, 64, 3
        fi = _RecordingFlashInfer(hidden)
        env = {"w4a16": inputs["w4a16"], _PER_TOKEN_ENV: inputs["per_token"]}
        with contextlib.ExitStack() as stack:
            stack.enter_context(self._environment(**env))
            stack.enter_context(rc.override_platform(is_blackwell=True, is_sm100=True))
            stack.enter_context(rc.get_flags().moe.override(runner_backend=u.MoeRunnerBackend.FLASHINFER_CUTEDSL,
                                                            a2a_backend=a2a))
            stack.enter_context(mock.patch.dict(sys.modules, fi.modules))
            stack.enter_context(mock.patch.object(self.fu, "fp4_quantize", fi.fp4_quantize))
            # GPU-only sizing probes of ensure_cutedsl_wrapper: one rank, CUDA graphs off.
            stack.enter_context(mock.patch.object(cutedsl, "cuda_graph_fully_disabled", return_value=True))
            stack.enter_context(mock.patch.object(cutedsl, "cutedsl_moe_max_num_tokens", return_value=8))
            stack.enter_context(mock.patch.object(cutedsl, "get_parallel", return_value=_ns(num_dp_ranks=1)))
            if inputs["quantization"] == "nvfp4_online":
                online = m("sglang.srt.layers.quantization.nvfp4_online")
                method = online.ModelOptNvFp4OnlineFusedMoEMethod(online.NvFp4OnlineConfig(), "model.layers.0.mlp.experts")
            else:
                method = self.mq.ModelOptNvFp4FusedMoEMethod(self._quant_config())
            config = base.MoeRunnerConfig(activation="silu", num_experts=experts, num_local_experts=experts, top_k=1,
                                          hidden_size=hidden, intermediate_size_per_partition=inter,
                                          params_dtype=torch.bfloat16)
            method.create_moe_runner(_ns(), config)  # SGLang's MoeRunner picks the fused function for the A2A backend
            one = torch.ones(experts)
            layer = _ns(_cutedsl_wrapper=None, _mega_moe_nvfp4=False, dispatcher=_ns(), top_k=1, moe_runner_config=config,
                        num_experts=experts, num_local_experts=experts, moe_ep_rank=0, hidden_size=hidden,
                        intermediate_size_per_partition=inter, quant_config=method.quant_config,
                        w13_weight=torch.zeros(experts, 2 * inter, hidden // 2, dtype=torch.uint8),
                        w2_weight=torch.zeros(experts, hidden, inter // 2, dtype=torch.uint8),
                        w13_blockscale_swizzled=torch.zeros(1), w2_blockscale_swizzled=torch.zeros(1),
                        **{n: one.clone() for n in ("g1_alphas", "g2_alphas", "w13_input_scale_quant",
                                                    "w2_input_scale_quant", "w13_weight_scale_2", "w2_weight_scale_2")})
            routing = topk.StandardTopKOutput(torch.ones(tokens, 1), torch.zeros(tokens, 1, dtype=torch.int32), None)
            x = torch.randn(tokens, hidden).bfloat16()
            if dispatch in ("none", "flashinfer_prefill"):  # eager prefill: the all-gather hands a standard output over
                handed = standard.StandardDispatchOutput(x, None, routing)
            elif dispatch == "flashinfer_decode_bf16":
                handed = fi_disp.FlashinferDispatchOutput(x, None, routing)
            else:
                handed = fi_disp.FlashinferDispatchOutput(torch.zeros(tokens, hidden // 2, dtype=torch.uint8),
                                                          torch.zeros(tokens, hidden // 16, dtype=torch.uint8), routing)
            combine = method.apply(layer, handed)
        seen = _activations_seen(fi)
        kinds = {"StandardCombineInput": "standard", "FlashinferCombineInput": "flashinfer"}
        seen["combine"] = kinds.get(type(combine).__name__, type(combine).__name__)
        return seen

    # ---- FP4 all-gather / dispatch ---------------------------------------------------------------------------

    def fp4_dispatch(self, inputs: Inputs) -> dict[str, Any]:
        u, rc, mq = self.moe_utils, self.runtime, self.mq
        nvfp4 = inputs["nvfp4_dispatch"] == "1"
        dp = inputs["dp_attention"] == "on"
        execution = _ns(moe=_ns(flashinfer_a2a_dispatch_type="nvfp4" if nvfp4 else "bf16"))
        with contextlib.ExitStack() as stack:
            stack.enter_context(self._environment(w4a16=inputs["w4a16"]))
            stack.enter_context(rc.get_flags().moe.override(
                runner_backend=u.MoeRunnerBackend(inputs["runner"]), a2a_backend=u.MoeA2ABackend(inputs["a2a"]),
                disable_fp4_allgather=False, quantization="modelopt_fp4"))
            stack.enter_context(rc.get_flags().dp.override(enabled=dp))
            stack.enter_context(rc.get_parallel().override(moe_ep_size=4, attn_dp_size=4 if dp else 1))
            # The resolved dispatch: no A2A reads the module constant taken from the env at import, FlashInfer
            # A2A reads the resolved --flashinfer-a2a-dispatch-type.
            stack.enter_context(mock.patch.object(mq, "MOE_NVFP4_DISPATCH", nvfp4))
            stack.enter_context(mock.patch.object(u, "get_exec", lambda: execution))
            stack.enter_context(mock.patch.object(mq, "get_platform", lambda: _ns(is_blackwell=True, is_sm100=True)))
            method = mq.ModelOptNvFp4FusedMoEMethod(_ns(use_per_token_activation=inputs["per_token"] == "1"))
            fn = mq.ModelOptNvFp4FusedMoEMethod.process_weights_after_loading
            scope = {"self": method, "moe_runner_backend": u.get_moe_runner_backend(),
                     "use_nvfp4_dispatch": mq._use_nvfp4_dispatch()}
            scope["use_w4a16"] = _source.eval_assignment(fn, mq, "use_w4a16", scope)
            return {"dispatch_fp4": bool(_source.eval_assignment(fn, mq, "use_dispatch_fp4", scope))}

    # ---- derived parameters ----------------------------------------------------------------------------------

    def bind_derived_param(self, module, source_name, derived_name, value) -> None:
        self.common.alias_or_bind_derived_param(module, source_name, derived_name, value)

    # ---- checkpoint config -> quantization method ------------------------------------------------------------

    def quant_method(self, config_json, hf_quant_config) -> dict[str, Any]:
        model_config = import_sglang_module("sglang.srt.configs.model_config")
        registry = import_sglang_module("sglang.srt.layers.quantization")
        cfg = model_config.ModelConfig.__new__(model_config.ModelConfig)
        as_loaded = json.loads(json.dumps(config_json)) if config_json is not None else None
        cfg.hf_config = _ns(quantization_config=as_loaded, compression_config=None)
        with tempfile.TemporaryDirectory() as model_dir:  # a local model directory: no hub access
            cfg.model_path, cfg.revision = model_dir, None
            if hf_quant_config is not None:
                with open(os.path.join(model_dir, "hf_quant_config.json"), "w") as f:
                    json.dump(hf_quant_config, f)
            parsed = cfg._parse_quant_hf_config()
        method = parsed.get("quant_method") if parsed else None
        try:
            config_class = registry.get_quantization_config(method).__name__ if method else None
        except ValueError:
            config_class = None
        fmt = group = None
        if method == "modelopt_fp4":
            source = as_loaded if as_loaded is not None else hf_quant_config
            try:
                loaded = self.mq.ModelOptFp4Config.from_config(dict(source))
            except ValueError:
                fmt = "rejected"
            else:
                fmt = "W4A16_NVFP4" if loaded.is_w4a16 else ("NVFP4_AWQ" if loaded.is_awq else "NVFP4")
                group = loaded.group_size
        return {"quant_method": method, "config_class": config_class, "fp4_format": fmt, "group_size": group}

    # ---- MIXED_PRECISION per-module formats ------------------------------------------------------------------

    def mixed_layer(self, quantized_layers, packed, kind, prefix, name_mapping=None) -> dict[str, Any]:
        m = import_sglang_module
        layer_cls = {"linear": m("sglang.srt.layers.linear").ReplicatedLinear,
                     "lm_head": m("sglang.srt.layers.vocab_parallel_embedding").ParallelLMHead,
                     "moe": m("sglang.srt.layers.moe.fused_moe_triton").FusedMoE}[kind]
        config = self.mq.ModelOptMixedPrecisionConfig.from_config(
            {"quant_algo": "MIXED_PRECISION", "quantized_layers": json.loads(json.dumps(quantized_layers)),
             "packed_modules_mapping": dict(packed)})
        if name_mapping:
            config.apply_weight_name_mapper(m("sglang.srt.models.utils").WeightsMapper(orig_to_new_prefix=dict(name_mapping)))
        layer = object.__new__(layer_cls)  # get_quant_method reads only the module's type
        with mock.patch.object(self.mq, "get_platform", lambda: _ns(is_blackwell=True, is_sm100=True)), \
                self._fp4_backend("flashinfer_cutlass"):
            method = config.get_quant_method(layer, prefix)
        return {"quant_algo": config._resolve_quant_algo(prefix), "method": type(method).__name__ if method else None}
