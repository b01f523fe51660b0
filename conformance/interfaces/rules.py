"""The engine adapter interface for the configuration and guard rules (docs/contracts.md sections 4-6).

An engine adapter answers, for one combination of inputs taken from a matrix in ``fixtures/config_rules/``,
what the engine decides: a value (a plain dict), or the exception the engine raises (let it propagate).
All inputs are strings as the matrices spell them. An env value is ``"unset"`` or the text the variable is
set to: ``"0"``/``"1"`` in most matrices, other spellings (``"true"``, ``"no"``, ``"on"``, ...) in ``env_flags``;
pass it on verbatim, the engine's own parsing is under test. An adapter must restore every process-wide
state it touches (environment variables, module globals) before returning.

Select one with ``pytest --engine NAME|module:attr`` or ``NVFP4_CONFORMANCE_ENGINE``; built-ins are
``reference``, ``sglang`` (the real SGLang 0.5.23 code on CPU) and ``vllm`` (vLLM 0.32's kernel selection on CPU). The expected outcomes come from a rules
profile (``--rules-profile``, default sglang-0.5.23). Matrices and outcomes: docs/rules.md.

The methods after ``reload_param`` were added with the rule profiles; they are optional: an engine that does
not implement one reports that matrix as unsupported (its cases skip, naming the missing method).
"""
from __future__ import annotations

import abc
from collections.abc import Mapping
from typing import Any, Optional

import torch

Inputs = Mapping[str, str]


class RulesEngine(abc.ABC):
    """Rules of one engine. Each method handles one matrix (named in its docstring)."""

    #: Short name shown in reports.
    name: str = "unnamed"

    def version(self) -> str:
        return "unknown"

    def use_profile(self, profile: str) -> None:
        """Told the rules profile under test. An engine that can take on several (the reference) switches;
        a real engine is one version and ignores it (a mismatch shows as failing cases)."""

    def unsupported(self, matrix: str, inputs: Inputs) -> str | None:
        """``None`` if the case can be run here, otherwise why not (the case skips with that reason).
        Overrides must return ``super().unsupported(...)`` when they have no reason of their own."""
        method = OPTIONAL_METHODS.get(matrix)
        if matrix == "env_flags" and inputs.get("flag") == "per_token":  # asked through moe_activation
            method = OPTIONAL_METHODS["moe_activation"]
        if method and getattr(type(self), method) is getattr(RulesEngine, method):
            return f"engine {self.name!r} does not implement RulesEngine.{method} (matrix {matrix})"
        return None

    @abc.abstractmethod
    def resolve_dense(self, inputs: Inputs) -> dict[str, Any]:
        """``dense``: env ``w4a16``, ``fp4_backend``, ``platform`` (for ``auto``), checkpoint ``quant_algo`` ->
        ``{"linear_method": class name, "quant_mode": "w4a4"|"w4a16"|None}``."""

    @abc.abstractmethod
    def fp4_gemm_dispatch(self, inputs: Inputs) -> dict[str, Any]:
        """``fp4_gemm``: ``quant_mode``, ``fp4_backend`` -> ``{"kernel": "mm_fp4"|"mm_bf16_fp4",
        "flashinfer_backend": str}`` (an unknown mode raises ValueError)."""

    @abc.abstractmethod
    def resolve_moe(self, inputs: Inputs) -> dict[str, Any]:
        """``moe``: env ``w4a16``, ``runner``, ``a2a``, ``deepep_mode`` -> ``{"quant_mode": ...}`` of an NVFP4
        (modelopt_fp4) MoE layer, after the server-argument checks."""

    @abc.abstractmethod
    def validate_a2a(self, inputs: Inputs) -> dict[str, Any]:
        """``a2a``: ``a2a``, env ``w4a16``, env ``nvfp4_dispatch``, ``dispatch_type``, ``runner``, ``quantization``
        -> ``{"dispatch": "bf16"|"nvfp4"|"mxfp8"|None}`` (None: the A2A backend has no dispatch dtype)."""

    @abc.abstractmethod
    def fusion_enabled(self, inputs: Inputs) -> dict[str, Any]:
        """``fusion``: ``model``, ``gate_up`` (``nvfp4_w4a4``/``nvfp4_w4a16``/``unquantized``), ``fp4_backend``
        -> ``{"enabled": bool}`` for the model's NVFP4-activation fusion."""

    @abc.abstractmethod
    def lm_head_guard(self, method: str | None, quant_mode: str | None, weight_dtype: str | None,
                      attrs: tuple[str, ...]) -> bool:
        """``lm_head``: does a head in this state run this quant method (class name; None = no method)?
        ``weight_dtype`` is a torch dtype name (None = no weight attribute), ``attrs`` the attributes present."""

    @abc.abstractmethod
    def reload_param(self, module: torch.nn.Module, name: str, new_value: torch.Tensor, *, graph_captured: bool) -> None:
        """``reload``: bind ``new_value`` to ``module.<name>`` the way the engine re-prepares weights after a
        reload (``graph_captured``: CUDA graphs captured the current storage)."""

    # ---- optional ---------------------------------------------------------------------------------------------

    def fp4_gemm_backend(self, inputs: Inputs) -> dict[str, Any]:
        """``fp4_backend``: ``fp4_backend`` (as given to --fp4-gemm-backend), ``platform`` (sm100, sm90, sm120,
        sm121, cpu) -> ``{"backend": the FP4 GEMM runner backend it resolves to}``."""
        raise NotImplementedError(f"{type(self).__name__} does not implement RulesEngine.fp4_gemm_backend")

    def moe_activation(self, inputs: Inputs) -> dict[str, Any]:
        """``moe_activation``: ``quantization`` (modelopt_fp4 | nvfp4_online), env ``w4a16``, env ``per_token``
        (SGLANG_FLASHINFER_NVFP4_PER_TOKEN_ACTIVATION), ``dispatch`` -> what the flashinfer_cutedsl runner hands
        the CuTe DSL kernel: ``{"activations": bf16|nvfp4_static|nvfp4_per_token|nvfp4_dispatched, "x_sf":
        bool, "per_token_scale": bool, "fc2_input_scale": bool, "combine": standard|flashinfer}``."""
        raise NotImplementedError(f"{type(self).__name__} does not implement RulesEngine.moe_activation")

    def fp4_dispatch(self, inputs: Inputs) -> dict[str, Any]:
        """``fp4_dispatch``: ``runner``, ``a2a``, env ``w4a16``, ``nvfp4_dispatch`` (resolved, 0|1),
        ``dp_attention`` (off|on, with ep_size == attn_dp_size), ``per_token`` (0|1) -> ``{"dispatch_fp4":
        bool}``: whether the NVFP4 MoE layer has its dispatcher quantize activations to NVFP4."""
        raise NotImplementedError(f"{type(self).__name__} does not implement RulesEngine.fp4_dispatch")

    def bind_derived_param(self, module: torch.nn.Module, source_name: str, derived_name: str,
                           value: torch.Tensor) -> None:
        """``derived_param``: bind ``value`` (derived from ``module.<source_name>``) under ``derived_name`` the
        way the engine's post-load processing does (alias into the source's storage when it can)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement RulesEngine.bind_derived_param")

    def quant_method(self, config_json: Optional[Mapping[str, Any]],
                     hf_quant_config: Optional[Mapping[str, Any]]) -> dict[str, Any]:
        """``quant_method``: a checkpoint's config.json ``quantization_config`` and/or hf_quant_config.json ->
        ``{"quant_method", "config_class", "fp4_format" (modelopt_fp4: the checkpoint format its config
        accepts, or "rejected"), "group_size"}``."""
        raise NotImplementedError(f"{type(self).__name__} does not implement RulesEngine.quant_method")

    def mixed_layer(self, quantized_layers: Mapping[str, Any], packed: Mapping[str, list], kind: str, prefix: str,
                    name_mapping: Optional[Mapping[str, str]] = None) -> dict[str, Any]:
        """``mixed_layers``: a MIXED_PRECISION checkpoint's ``quantized_layers`` (after renaming checkpoint name
        prefixes per ``name_mapping``), fused-module ``packed`` map, and a runtime module (``kind``: linear |
        lm_head | moe, its ``prefix``) -> ``{"quant_algo", "method": quant method class name or None}``."""
        raise NotImplementedError(f"{type(self).__name__} does not implement RulesEngine.mixed_layer")


    def vllm_linear_kernel(self, inputs: Inputs) -> dict[str, Any]:
        """``vllm_linear``: ``platform``, ``linear_backend`` (--linear-backend), ``batch_invariant``
        (VLLM_BATCH_INVARIANT 0|1), ``humming`` (installed|absent) -> ``{"kernel": the NVFP4 linear kernel class
        vLLM instantiates for a W4A16_NVFP4 layer}`` (or the engine's exception)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement RulesEngine.vllm_linear_kernel")

    def vllm_moe_backend(self, inputs: Inputs) -> dict[str, Any]:
        """``vllm_moe``: ``platform``, ``moe_backend`` (--moe-backend), ``humming`` -> ``{"backend": the
        NvFp4MoeBackend selected for a W4A16_NVFP4 MoE layer}`` (or the engine's exception)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement RulesEngine.vllm_moe_backend")


#: matrix -> the optional RulesEngine method that answers it
OPTIONAL_METHODS = {"fp4_backend": "fp4_gemm_backend", "moe_activation": "moe_activation",
                    "fp4_dispatch": "fp4_dispatch", "derived_param": "bind_derived_param",
                    "quant_method": "quant_method", "mixed_layers": "mixed_layer",
                    "vllm_linear": "vllm_linear_kernel", "vllm_moe": "vllm_moe_backend"}
