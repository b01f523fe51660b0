"""The ``sglang`` rules engine: SGLang 0.5.23's own rule code, imported and called on a CPU host.

What is called (looked up on the SGLang modules at call time, so a monkeypatched SGLang function is what runs):
- dense: ``fp4_utils.initialize_fp4_gemm_config`` (``auto`` resolution), ``ModelOptFp4Config.from_config`` and
  ``get_quant_method`` on a ``ReplicatedLinear`` -> the linear method SGLang picks and its ``quant_mode``;
- fp4_gemm: the Python body of the ``sglang::fp4_gemm`` op (``modelopt_quant.fp4_gemm.__wrapped__``), with
  recording stand-ins for FlashInfer's ``mm_fp4``/``mm_bf16_fp4`` (the GPU kernels cannot run here);
- a2a / moe server arguments: ``moe_hook.handle_moe_kernel_config`` then ``moe_hook.handle_a2a_moe`` on a
  record carrying the server-argument fields they read (plus a fixture ModelConfig, as SGLang's own tests do);
- moe layer: a real ``ModelOptNvFp4FusedMoEMethod`` under the resolved runner/A2A flags; its W4A16 decision
  and its v1-DeepEP W4A16 rejection are statements inside ``process_weights_after_loading``/``apply`` that
  need a loaded GPU layer, so we execute exactly those statements, taken from the installed source
  (:mod:`conformance.interfaces.upstream_source`);
- fusion: qwen3_5's ``_maybe_enable_silu_fp4_quant_fusion`` (called), deepseek_v2's shared-expert fusion
  condition (inline in ``DeepseekV2MoE.__init__``: its ``if`` test is taken from the installed source);
- lm_head: ``logits_processor.should_apply_lm_head_quant_method`` on a real module and real method objects;
- reload: ``layers.utils.common.copy_or_rebind_param``; for state a CUDA graph captured (``graph_captured``
  with an existing Parameter) the CuTe DSL MoE scale refresh ``refresh_cutedsl_standard_scales_for_weight_update``,
  where 0.5.23 keeps its recapture guard (the Parameter plays the captured GEMM1 alpha);
- fp4_backend: ``fp4_utils.initialize_fp4_gemm_config`` under the case's platform probes;
- the other matrices added with the rule profiles: see :mod:`.rule_paths`.

Hardware probes are answered by the case (``platform``: SM100 / SM90 / SM120 / SM121 / CPU) by patching SGLang's
probe functions for the duration of one call; environment variables and SGLang's module globals are restored
after every call.
"""
from __future__ import annotations

import contextlib
import logging
import os
import types
from collections.abc import Iterator
from typing import Any

import torch

from conformance.interfaces.rules import Inputs, RulesEngine
from conformance.interfaces import upstream_source as _source
from conformance.adapters.sglang._import import SGLangUnavailable, import_sglang_module, sglang_version
from conformance.adapters.sglang.rule_paths import SGLangPathRules

_ENV_NAMES = {"w4a16": "SGLANG_FLASHINFER_CUTEDSL_NVFP4_W4A16", "nvfp4_dispatch": "SGLANG_MOE_NVFP4_DISPATCH"}
_CAPABILITY = {"sm100": (10, 0), "sm90": (9, 0), "sm120": (12, 0), "sm121": (12, 1), "cpu": (0, 0)}


@contextlib.contextmanager
def _environment(**values: str) -> Iterator[None]:
    """Set env vars (``"unset"`` removes one) and restore the whole environment afterwards
    (SGLang writes to it, e.g. auto-enabling SGLANG_MOE_NVFP4_DISPATCH)."""
    saved = dict(os.environ)
    try:
        for key, value in values.items():
            name = _ENV_NAMES.get(key, key)
            if value == "unset":
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@contextlib.contextmanager
def _patched(obj: Any, **attrs: Any) -> Iterator[None]:
    missing = object()
    saved = {k: getattr(obj, k, missing) for k in attrs}
    try:
        for k, v in attrs.items():
            setattr(obj, k, v)
        yield
    finally:
        for k, v in saved.items():
            if v is missing:
                delattr(obj, k)
            else:
                setattr(obj, k, v)


def _ns(**kw: Any) -> types.SimpleNamespace:
    return types.SimpleNamespace(**kw)


class SGLangRules(SGLangPathRules, RulesEngine):
    name = "sglang"
    _environment = staticmethod(_environment)

    def __init__(self) -> None:
        m = import_sglang_module
        self.mq = m("sglang.srt.layers.quantization.modelopt_quant")
        self.fu = m("sglang.srt.layers.quantization.fp4_utils")
        self.hook = m("sglang.srt.arg_groups.moe_hook")
        self.logits = m("sglang.srt.layers.logits_processor")
        self.common = m("sglang.srt.layers.utils.common")
        self.linear = m("sglang.srt.layers.linear")
        self.moe_utils = m("sglang.srt.layers.moe.utils")
        self.runtime = m("sglang.srt.runtime_context")
        self.deepseek = m("sglang.srt.models.deepseek_v2")
        self.qwen = m("sglang.srt.models.qwen3_5")
        self.cutedsl = m("sglang.srt.layers.moe.moe_runner.flashinfer_cutedsl")
        import flashinfer

        self.flashinfer = flashinfer
        # Resolution logs a warning per decision; thousands of cases would drown the test output.
        logging.getLogger("sglang").setLevel(logging.ERROR)

    def version(self) -> str:
        return f"sglang {sglang_version()} (CPU, rule code only)"

    # ---- dense --------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _fp4_backend(self, backend: str, platform: str = "cpu") -> Iterator[None]:
        """Run SGLang's own FP4 GEMM backend initialisation for ``backend`` on ``platform``."""
        fu = self.fu
        probes = dict(
            get_exec=lambda: _ns(kernel=_ns(fp4_gemm_runner_backend=backend)),
            get_platform=lambda: _ns(is_sm100=platform == "sm100"),
            is_cuda=lambda: platform != "cpu",
            get_device_capability=lambda *a, **k: _CAPABILITY[platform],
        )
        saved = fu.FP4_GEMM_RUNNER_BACKEND
        try:
            with _patched(fu, **probes):
                fu.initialize_fp4_gemm_config()
            yield
        finally:
            fu.FP4_GEMM_RUNNER_BACKEND = saved

    def fp4_gemm_backend(self, inputs: Inputs) -> dict[str, Any]:
        with self._fp4_backend(inputs["fp4_backend"], inputs["platform"]):
            return {"backend": self.fu.get_fp4_gemm_runner_backend().value}

    def _quant_config(self, quant_algo: str = "NVFP4"):
        return self.mq.ModelOptFp4Config.from_config(
            {"quantization": {"quant_algo": quant_algo, "group_size": 16, "exclude_modules": []},
             "packed_modules_mapping": {}})  # the model sets it at load; no fused shards here

    def resolve_dense(self, inputs: Inputs) -> dict[str, Any]:
        with _environment(w4a16=inputs["w4a16"]), self._fp4_backend(inputs["fp4_backend"], inputs["platform"]):
            config = self._quant_config(inputs["quant_algo"])
            layer = object.__new__(self.linear.ReplicatedLinear)  # only its type is consulted
            method = config.get_quant_method(layer, "model.layers.0.mlp.down_proj")
        return {"linear_method": type(method).__name__, "quant_mode": getattr(method, "quant_mode", None)}

    def _linear_method(self, quant_mode: str):
        """A real ModelOptFp4LinearMethod built under the settings that give ``quant_mode``."""
        w4a16 = "1" if quant_mode == "w4a16" else "unset"
        with _environment(w4a16=w4a16), self._fp4_backend("flashinfer_cutedsl"):
            method = self.mq.ModelOptFp4LinearMethod(self._quant_config())
        assert method.quant_mode == quant_mode, (method.quant_mode, quant_mode)
        return method

    def fp4_gemm_dispatch(self, inputs: Inputs) -> dict[str, Any]:
        calls: list[tuple[str, str]] = []

        def mm_fp4(*args, backend, **kw):
            calls.append(("mm_fp4", backend))
            return torch.zeros(1, 1)

        def mm_bf16_fp4(*args, backend, **kw):
            calls.append(("mm_bf16_fp4", backend))
            return torch.zeros(1, 1)

        x = torch.zeros(1, 32, dtype=torch.bfloat16)
        w = torch.zeros(32, 16, dtype=torch.uint8)
        sf = torch.zeros(32, 2, dtype=torch.float8_e4m3fn)
        with self._fp4_backend(inputs["fp4_backend"]), _patched(self.mq, flashinfer_fp4_gemm=mm_fp4), \
                _patched(self.flashinfer, mm_bf16_fp4=mm_bf16_fp4):
            self.mq.fp4_gemm.__wrapped__(x, w, None, sf, torch.ones(()), torch.bfloat16, 32,
                                         quant_mode=inputs["quant_mode"])
        if len(calls) != 1:
            raise AssertionError(f"fp4_gemm called FlashInfer {len(calls)} times: {calls}")
        return {"kernel": calls[0][0], "flashinfer_backend": calls[0][1]}

    # ---- MoE server arguments -------------------------------------------------------------------------------

    @staticmethod
    def _server_args(*, a2a: str, runner: str, quantization: str, dispatch_type: str = "none",
                     deepep_mode: str = "auto"):
        """The server-argument fields handle_moe_kernel_config/handle_a2a_moe read, TP4 with DP attention 4
        (the topology FlashInfer A2A requires), and a fixture ModelConfig (no hybrid NVFP4 MoE metadata)."""
        args = _ns(
            moe_a2a_backend=a2a, moe_runner_backend=runner,
            quantization=None if quantization == "bf16" else quantization,
            flashinfer_a2a_dispatch_type=None if dispatch_type == "none" else dispatch_type,
            deepep_mode=deepep_mode, tp_size=4, ep_size=4, attn_dp_size=4, nnodes=1, enable_waterfill=False,
            enable_layernorm_sp=False, disable_shared_experts_fusion=False,
            cuda_graph_config=import_sglang_module("sglang.srt.model_executor.cuda_graph_config").default_cuda_graph_config(),
            speculative_algorithm=None, speculative_moe_a2a_backend=None, ep_scale_joiner=False,
        )
        args._model_config = _ns(nvfp4_moe_meta=None, is_fp4_experts=False, dtype=torch.bfloat16,
                                 hf_config=_ns(architectures=["DeepseekV3ForCausalLM"]))
        return args

    def _resolve_server_args(self, args) -> None:
        platform = _ns(is_sm100=True, is_sm110=False, is_sm120=False, is_npu=False, is_hip=False)
        overrides = import_sglang_module("sglang.srt.arg_groups.overrides")
        with _patched(overrides, get_platform=lambda: platform), _patched(self.hook, get_platform=lambda: platform):
            self.hook.handle_moe_kernel_config(args)
            self.hook.handle_a2a_moe(args)

    @staticmethod
    def _resolved(args, field: str) -> Any:
        value = getattr(args, field)
        for _source_name, declared in getattr(args, "_resolved_overrides", None) or ():
            value = declared.get(field, value)
        return value

    def validate_a2a(self, inputs: Inputs) -> dict[str, Any]:
        args = self._server_args(a2a=inputs["a2a"], runner=inputs["runner"], quantization=inputs["quantization"],
                                 dispatch_type=inputs["dispatch_type"])
        with _environment(w4a16=inputs["w4a16"], nvfp4_dispatch=inputs["nvfp4_dispatch"]):
            self._resolve_server_args(args)
            if self._resolved(args, "moe_a2a_backend") != "flashinfer":
                return {"dispatch": None}
            declared = self._resolved(args, "flashinfer_a2a_dispatch_type")
            if declared is not None:
                return {"dispatch": declared}
            envs = import_sglang_module("sglang.srt.environ").envs
            return {"dispatch": "nvfp4" if envs.SGLANG_MOE_NVFP4_DISPATCH.get() else "bf16"}

    # ---- MoE layer --------------------------------------------------------------------------------------------

    def resolve_moe(self, inputs: Inputs) -> dict[str, Any]:
        args = self._server_args(a2a=inputs["a2a"], runner=inputs["runner"], quantization="modelopt_fp4",
                                 deepep_mode=inputs["deepep_mode"])
        with _environment(w4a16=inputs["w4a16"]):
            self._resolve_server_args(args)
            runner = self._resolved(args, "moe_runner_backend")
            a2a = self._resolved(args, "moe_a2a_backend")
            moe_flags = self.runtime.get_flags().moe
            u = self.moe_utils
            with _patched(moe_flags, runner_backend=u.MoeRunnerBackend(runner), a2a_backend=u.MoeA2ABackend(a2a)), \
                    _patched(self.mq, get_platform=lambda: _ns(is_blackwell=True, is_sm100=True)):
                method = self.mq.ModelOptNvFp4FusedMoEMethod(self._quant_config())
                namespace = {"self": method, "moe_runner_backend": u.get_moe_runner_backend()}
                # apply(): the CuTe DSL v1 (DeepEP) branch's W4A16 rejection, exactly as written there.
                if method._is_cutedsl_v1_deepep:
                    _source.run_nested_if(self.mq.ModelOptNvFp4FusedMoEMethod.apply, self.mq,
                                          outer="self._is_cutedsl_v1_deepep", marker="raise ValueError",
                                          namespace=namespace)
                # process_weights_after_loading(): `use_w4a16 = ...`, exactly as written there.
                use_w4a16 = _source.eval_assignment(self.mq.ModelOptNvFp4FusedMoEMethod.process_weights_after_loading,
                                                    self.mq, "use_w4a16", namespace)
        return {"quant_mode": "w4a16" if use_w4a16 else "w4a4"}

    # ---- fusion guards ----------------------------------------------------------------------------------------

    def fusion_enabled(self, inputs: Inputs) -> dict[str, Any]:
        gate_up = inputs["gate_up"]
        if gate_up == "unquantized":
            gate_method = self.mq.UnquantizedLinearMethod()
        else:
            gate_method = self._linear_method(gate_up.removeprefix("nvfp4_"))
        down_method = self._linear_method("w4a4")
        with self._fp4_backend(inputs["fp4_backend"]), _environment(SGLANG_DISABLE_SILU_FP4_QUANT_FUSION="unset"):
            if inputs["model"] == "qwen3_5":
                mlp = _ns(gate_up_proj=_ns(quant_method=gate_method), down_proj=_ns(quant_method=down_method))
                self.qwen._maybe_enable_silu_fp4_quant_fusion(mlp)
                return {"enabled": bool(getattr(mlp, "_enable_silu_fp4_quant_fusion", False))}
            if inputs["model"] == "deepseek_v2":
                shared = _ns(gate_up_proj=_ns(quant_method=gate_method, output_size_per_partition=256),
                             down_proj=_ns(quant_method=down_method), swiglu_limit=None)
                namespace = {
                    "self": _ns(shared_experts=shared), "fc1_n": 256,
                    # the other preconditions held true: SM100, no LoRA, no piecewise prefill CUDA graph
                    "get_platform": lambda: _ns(is_sm100=True),
                    "get_lora": lambda: _ns(enable_lora=False, lora_paths=None),
                    "check_cuda_graph_backend": lambda *a, **k: False,
                    "ModelOptFp4LinearMethod": self.mq.ModelOptFp4LinearMethod,
                    "get_fp4_gemm_runner_backend": self.fu.get_fp4_gemm_runner_backend,
                }
                enabled = _source.eval_if_test(self.deepseek.DeepseekV2MoE.__init__, self.deepseek,
                                               marker="_enable_nvfp4_gemm_swiglu_fusion = True", namespace=namespace)
                return {"enabled": bool(enabled)}
        raise ValueError(f"unknown model {inputs['model']!r}")

    # ---- LM head ----------------------------------------------------------------------------------------------

    def _method_object(self, method: str | None, quant_mode: str | None):
        if method is None:
            return None
        if method == "ModelOptFp4LinearMethod":
            return self._linear_method(quant_mode)
        if method == "ModelOptNvFp4A16LinearMethod":
            return self.mq.ModelOptNvFp4A16LinearMethod(self._quant_config("W4A16_NVFP4"))
        if method == "UnquantizedLinearMethod":
            return self.mq.UnquantizedLinearMethod()
        if method == "ModelOptFp8LinearMethod":
            # The guard reads only the method's type; its config needs an FP8 checkpoint we do not have.
            return object.__new__(self.mq.ModelOptFp8LinearMethod)
        raise ValueError(f"unknown method {method!r}")

    def lm_head_guard(self, method, quant_mode, weight_dtype, attrs) -> bool:
        head = torch.nn.Module()
        if weight_dtype is not None:
            dtype = getattr(torch, weight_dtype)
            head.weight = torch.nn.Parameter(torch.zeros(4, 8, dtype=dtype), requires_grad=False)
        for attr in attrs:
            setattr(head, attr, torch.nn.Parameter(torch.zeros(1), requires_grad=False))
        return bool(self.logits.should_apply_lm_head_quant_method(head, self._method_object(method, quant_mode)))

    # ---- reload ----------------------------------------------------------------------------------------------

    def reload_param(self, module, name, new_value, *, graph_captured: bool) -> None:
        current = getattr(module, name, None)
        if graph_captured and isinstance(current, torch.nn.Parameter):
            self._refresh_captured_scale(current, new_value)
        else:
            self.common.copy_or_rebind_param(module, name, new_value)

    def _refresh_captured_scale(self, captured: torch.Tensor, new_value: torch.Tensor) -> None:
        """A reload under captured CUDA graphs, as SGLang handles the state it captures: the CuTe DSL MoE
        scales are re-derived (``resolve_cutedsl_standard_scales``: here it yields ``new_value`` as the GEMM1
        alpha, the other scales unchanged) and ``refresh_cutedsl_standard_scales_for_weight_update`` writes
        them into the captured tensors in place, or raises RuntimeError asking for a recapture."""
        cutedsl = self.cutedsl
        others = (torch.ones(1), torch.ones(4), torch.ones(1))  # fc2 input scale, GEMM2 alpha, input scale
        layer = _ns(quant_config=_ns(use_per_token_activation=False), _cutedsl_wrapper=_ns(quant_mode="w4a16"),
                    _cutedsl_scales=(captured, others[0], others[1]), _cutedsl_input_scale=others[2])
        derived = (new_value.detach(), others[0].clone(), others[1].clone(), others[2].clone())
        with _patched(cutedsl, resolve_cutedsl_standard_scales=lambda _layer: derived):
            cutedsl.refresh_cutedsl_standard_scales_for_weight_update(layer)


def load() -> SGLangRules:
    """Factory used by the engine selector; raises SGLangUnavailable if SGLang cannot be imported."""
    return SGLangRules()


__all__ = ["SGLangRules", "SGLangUnavailable", "load"]
