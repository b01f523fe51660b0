"""``CuteDslMoEWrapper`` (FlashInfer 0.7.4 ``fused_moe/cute_dsl/fused_moe.py``) for ``quant_mode="w4a16"``:
constructor and ``run`` checks in FlashInfer's order, then the expert computation of the W4A16 kernel
pipeline (``blackwell/moe_w4a16.py:launch_w4a16_moe``):

* GEMM1 per routed (token, expert): BF16 activations x NVFP4 ``w1`` (rows ``[up; gate]`` interleaved in
  64-row groups, or 16-row groups with ``swap_ab``), fp32 accumulation, times ``w1_alpha[e]``;
* the gated activation in fp32, written to a BF16 intermediate (the kernel's intermediate buffer);
* GEMM2 the same way with ``w2`` and ``w2_alpha[e]``, written as BF16 per routed row;
* finalize: routing-weighted fp32 sum over the token's local experts, one BF16 rounding.

Like the kernel, the weights, scales and alphas are read as raw memory from ``data_ptr()`` (a scale view
of any shape works if its bytes are right); the emulator raises where the kernel would read out of
bounds. Tokens routed to experts outside ``[local_expert_offset, local_expert_offset + num_local_experts)``
contribute nothing. W4A4 / W4A8 / MXFP8 construction is checked but ``run`` is modelled for W4A16 only.
"""
from __future__ import annotations

import ctypes
import math
import warnings
from enum import IntEnum
from typing import Optional

import torch


DEFAULT_SWIGLU_ALPHA = 1.0
DEFAULT_SWIGLU_BETA = 0.0
DEFAULT_SWIGLU_LIMIT = torch.finfo(torch.float32).max
_UNSET = object()


class ActivationType(IntEnum):
    """Same member values as ``flashinfer.ActivationType`` (tllm_enums.py)."""

    Gelu = 0
    Relu = 1
    Silu = 2
    Swiglu = 3
    Geglu = 4
    SwigluBias = 5
    Relu2 = 6
    SwigluStep = 7
    GegluTanh = 8
    Identity = 9
    Situ = 10
    InvalidType = 11
    ClampedRelu2 = 12
    PowLU = 13


_GATED = {ActivationType.Swiglu, ActivationType.Geglu, ActivationType.SwigluBias, ActivationType.SwigluStep,
          ActivationType.GegluTanh, ActivationType.Situ, ActivationType.PowLU}
_CUTE_DSL_ACTIVATIONS = (ActivationType.Swiglu, ActivationType.GegluTanh, ActivationType.Relu2, ActivationType.ClampedRelu2)
_W4A16_ACTIVATIONS = (ActivationType.Swiglu, ActivationType.GegluTanh, ActivationType.Relu2)
_QUANT_MODES = ("w4a4", "w4a8", "w4a16", "mxfp8")
#: ``@supported_compute_capability([100, 103, 107])`` on the real ``CuteDslMoEWrapper.__init__``.
_WRAPPER_CCS = (100, 103, 107)


def _normalize_activation(activation_type, supported, backend: Optional[str] = None) -> tuple[ActivationType, bool]:
    """moe_utils.py:normalize_cute_dsl_moe_activation_type."""
    try:
        act = ActivationType(activation_type)
    except ValueError as err:
        raise ValueError(f"Unsupported activation_type {activation_type!r}") from err
    if act not in supported:
        expected = " or ".join(repr(t) for t in supported)
        where = f" for {backend}" if backend else ""
        raise ValueError(f"Unsupported activation_type {act!r}{where}; expected {expected}")
    return act, act in _GATED


def _finite_fp32(value: float, positive: bool = False) -> bool:
    if not math.isfinite(value) or (positive and value <= 0):
        return False
    f32 = ctypes.c_float(value).value
    return math.isfinite(f32) and (not positive or f32 > 0)


def _check_situ(act: ActivationType, situ_beta, situ_linear_beta) -> None:
    """moe_utils.py:validate_cute_dsl_moe_situ_config."""
    if situ_beta is None:
        if situ_linear_beta is not None:
            raise ValueError("situ_linear_beta requires situ_beta")
        return
    if act != ActivationType.Swiglu:
        raise ValueError("SiTU parameters require ActivationType.Swiglu")
    if not _finite_fp32(situ_beta, positive=True):
        raise ValueError("situ_beta must be positive and finite in fp32")
    raise NotImplementedError("flashinfer_emulator does not model the SiTU activation")


def _check_cute_dsl_config(act: ActivationType, quant_mode: str, output_dtype: torch.dtype,
                           clamped_relu2_limit: Optional[torch.Tensor], situ_beta: Optional[float],
                           situ_linear_beta: Optional[float]) -> None:
    """The constructor's checks of ``CuteDslMoEWrapper``, in FlashInfer's order (the first failing one raises)."""
    if act == ActivationType.ClampedRelu2:  # validate_cute_dsl_moe_clamped_relu2_config
        if clamped_relu2_limit is None:
            raise ValueError("ActivationType.ClampedRelu2 requires a one-element clamped_relu2_limit tensor")
        if clamped_relu2_limit.ndim != 1 or clamped_relu2_limit.numel() != 1:
            raise ValueError(
                "ActivationType.ClampedRelu2 requires model-wide clamped_relu2_limit with shape (1,), "
                f"got {tuple(clamped_relu2_limit.shape)}"
            )
    elif clamped_relu2_limit is not None:
        raise ValueError("clamped_relu2_limit is supported only with ActivationType.ClampedRelu2")
    _check_situ(act, situ_beta, situ_linear_beta)
    if act == ActivationType.ClampedRelu2 and quant_mode == "w4a16":  # _check_clamped_relu2_supported
        raise ValueError("ActivationType.ClampedRelu2 is not supported when quant_mode='w4a16'")
    if quant_mode in ("w4a8", "mxfp8") and output_dtype is not torch.bfloat16:
        raise ValueError(f"quant_mode={quant_mode!r} supports only bfloat16 output")
    if quant_mode == "w4a16":  # tuner.py:CuteDslFusedMoEW4A16Runner.__init__
        _normalize_activation(act, _W4A16_ACTIVATIONS, backend="W4A16")
        if output_dtype != torch.bfloat16:
            raise ValueError("W4A16 only supports BF16 output")
    elif quant_mode not in _QUANT_MODES:
        raise ValueError(f"quant_mode must be 'w4a4', 'w4a8', 'w4a16', or 'mxfp8' (got {quant_mode!r}).")


class CuteDslMoEWrapper:
    """Emulates ``flashinfer.CuteDslMoEWrapper`` (same constructor and ``run`` signature)."""

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        use_cuda_graph: bool = False,
        max_num_tokens: Optional[int] = None,
        num_local_experts: Optional[int] = None,
        local_expert_offset: int = 0,
        tile_size: int = 128,
        sf_vec_size: int = 16,
        output_dtype: torch.dtype = torch.bfloat16,
        device: str = "cuda",
        enable_pdl: bool = True,
        activation_type: int = ActivationType.Swiglu.value,
        swiglu_alpha: float = DEFAULT_SWIGLU_ALPHA,
        swiglu_beta: float = DEFAULT_SWIGLU_BETA,
        swiglu_limit: float = DEFAULT_SWIGLU_LIMIT,
        situ_beta: Optional[float] = None,
        situ_linear_beta: Optional[float] = None,
        use_fused_finalize: bool = True,
        quant_mode: str = "w4a4",
        clamped_relu2_limit: Optional[torch.Tensor] = None,
        swap_ab: bool = False,
    ):
        del max_num_tokens, tile_size, enable_pdl
        act, gated = _normalize_activation(activation_type, _CUTE_DSL_ACTIVATIONS)
        quant_mode = quant_mode.lower()
        if quant_mode == "nvfp4":
            warnings.warn("quant_mode='nvfp4' is deprecated; use quant_mode='w4a4' instead.", DeprecationWarning, 2)
            quant_mode = "w4a4"
        _check_cute_dsl_config(act, quant_mode, output_dtype, clamped_relu2_limit, situ_beta, situ_linear_beta)
        self.num_experts = num_experts
        self.top_k = top_k
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.use_cuda_graph = use_cuda_graph
        self.num_local_experts = num_local_experts or num_experts
        self.local_expert_offset = local_expert_offset
        self.sf_vec_size = sf_vec_size
        self.output_dtype = output_dtype
        self.device = device
        self.activation_type = act
        self.gated = gated
        self.swiglu_alpha, self.swiglu_beta, self.swiglu_limit = swiglu_alpha, swiglu_beta, swiglu_limit
        self.use_fused_finalize = use_fused_finalize
        self.quant_mode = quant_mode
        self.swap_ab = swap_ab

    def run(
        self,
        x: torch.Tensor,
        x_sf: Optional[torch.Tensor],
        token_selected_experts: torch.Tensor,
        token_final_scales: torch.Tensor,
        w1_weight: torch.Tensor,
        w1_weight_sf: torch.Tensor,
        w1_alpha: torch.Tensor,
        fc2_input_scale: Optional[torch.Tensor],
        w2_weight: torch.Tensor,
        w2_weight_sf: torch.Tensor,
        w2_alpha: torch.Tensor,
        tactic=None,
        *,
        per_token_scale: Optional[torch.Tensor] = None,
        nvfp4_4over6=_UNSET,
    ) -> torch.Tensor:
        """``CuteDslMoEWrapper.run``: ``[num_tokens, hidden_size]`` in ``output_dtype``."""
        del tactic
        num_tokens = token_selected_experts.size(0)
        if self.quant_mode == "w4a4" and x.dtype is not torch.uint8:
            raise TypeError("quant_mode='w4a4' requires packed uint8 input")
        if self.quant_mode != "w4a16":
            raise NotImplementedError(f"flashinfer_emulator models CuteDslMoEWrapper.run for w4a16 only, not {self.quant_mode}")
        if x_sf is not None or fc2_input_scale is not None or per_token_scale is not None:
            raise ValueError("x_sf, fc2_input_scale, and per_token_scale must be None when quant_mode='w4a16'")
        if nvfp4_4over6 is not _UNSET and nvfp4_4over6 is not None:  # _cute_dsl_recipe_kwargs
            raise ValueError(
                "nvfp4_4over6 requires quant_mode='w4a4' with per_token_scale; no other CuTe-DSL path has a "
                "4over6 requantization. Pass None to turn 4over6 off, or omit it to read the environment."
            )
        # tuner.py:CuteDslFusedMoEW4A16Runner.forward
        if x.dtype != torch.bfloat16:
            raise TypeError(f"W4A16 requires x.dtype=torch.bfloat16, got {x.dtype}")
        if token_final_scales.dtype != torch.float32:
            raise TypeError(f"W4A16 requires token_final_scales.dtype=torch.float32, got {token_final_scales.dtype}")
        hidden = int(w2_weight.size(1))
        if tuple(x.shape) != (num_tokens, hidden):
            raise ValueError(f"x must have shape {(num_tokens, hidden)} for W4A16, got {tuple(x.shape)}")
        # blackwell/moe_w4a16.py:launch_w4a16_moe
        inter = int(w2_weight.size(2)) * 2
        gemm1_rows = inter * (2 if self.gated else 1)
        if int(w1_weight.size(1)) != gemm1_rows:
            raise ValueError(
                f"w1_weight dim 1 must be {gemm1_rows} for {self.activation_type.name}, got {w1_weight.size(1)}"
            )
        from reference_impl.flashinfer_emulator._moe_compute import run_w4a16_experts

        return run_w4a16_experts(self, x, token_selected_experts, token_final_scales,
                                 w1_weight, w1_weight_sf, w1_alpha, w2_weight, w2_weight_sf, w2_alpha)


# The query FlashInfer's ``@supported_compute_capability`` attaches to ``CuteDslMoEWrapper.__init__``.
CuteDslMoEWrapper.__init__.is_compute_capability_supported = lambda cc: int(cc) in _WRAPPER_CCS
