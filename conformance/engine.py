"""The engine adapter interface for the configuration and guard rules (SPEC.md sections 4-6).

An engine adapter answers, for one combination of inputs taken from a matrix in ``fixtures/config_rules/``,
what the engine decides: a value (a plain dict), or the exception the engine raises (let it propagate).
All inputs are strings as the matrices spell them (env values ``"unset"``/``"0"``/``"1"``). An adapter must
restore every process-wide state it touches (environment variables, module globals) before returning.

Select one with ``pytest --engine NAME|module:attr`` or ``NVFP4_CONFORMANCE_ENGINE``; built-ins are
``reference`` and ``sglang`` (the real SGLang 0.5.23 code on CPU). Matrices and outcomes:
docs/config_rules.md.
"""
from __future__ import annotations

import abc
from collections.abc import Mapping
from typing import Any

import torch

Inputs = Mapping[str, str]


class RulesEngine(abc.ABC):
    """Rules of one engine. Each method handles one matrix (named in its docstring)."""

    #: Short name shown in reports.
    name: str = "unnamed"

    def version(self) -> str:
        return "unknown"

    def unsupported(self, matrix: str, inputs: Inputs) -> str | None:
        """``None`` if the case can be run here, otherwise why not (the case skips with that reason)."""
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
