"""MoE experts as the reference reads them, and their activations: the :class:`MoEExperts` record (the one
definition: ``conformance.interfaces.kernel.MoEExperts`` is this class; ``NVFP4Experts`` and ``ExpertWeights`` are
its 0.2 names),
:func:`apply_activation` and the expert-parallel offset. Shared by :mod:`reference_impl.moe` (the fused-MoE
math) and :mod:`reference_impl.moe.grouped` (its grouped-GEMM evaluation), so neither imports the other's
caller."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch

ACTIVATIONS = ("swiglu", "geglu", "relu2", "swiglu_oai")
GATED_ACTIVATIONS = frozenset({"swiglu", "geglu", "swiglu_oai"})
#: gpt-oss's values; SGLang hard-codes beta = 1 (``(up + 1)``), FlashInfer takes alpha/beta/limit.
SWIGLU_OAI_DEFAULTS = {"alpha": 1.702, "beta": 1.0, "limit": 7.0}
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


MoEActivation = Literal["swiglu", "geglu", "relu2", "swiglu_oai"]


@dataclass(frozen=True)
class MoEExperts:
    """The experts of one MoE layer on one expert-parallel rank, in checkpoint form.

    ``w13`` uint8 ``[E, 2I, H/2]`` as halves ``[gate; up]`` (``[E, I, H/2]`` for the non-gated relu2);
    ``w13_scale`` e4m3 ``[E, 2I, H/16]``; ``w13_scale_2`` fp32 ``[E, 2]`` (gate, up);
    ``w2`` uint8 ``[E, H, I/2]``; ``w2_scale`` e4m3 ``[E, H, I/16]``; ``w2_scale_2`` fp32 ``[E]``;
    input scales ``[num_global_experts, 2]`` / ``[num_global_experts]`` are present when the checkpoint
    has them and are neutral under W4A16. This rank owns global experts
    ``[ep_rank * E, (ep_rank + 1) * E)``; tokens routed elsewhere contribute nothing here.
    ``activation_params`` holds e.g. ``alpha``, ``beta``, ``limit`` for ``swiglu_oai``."""

    w13: torch.Tensor
    w13_scale: torch.Tensor
    w13_scale_2: torch.Tensor
    w2: torch.Tensor
    w2_scale: torch.Tensor
    w2_scale_2: torch.Tensor
    activation: MoEActivation = "swiglu"
    activation_params: dict[str, float] = field(default_factory=dict)
    num_global_experts: int | None = None
    ep_rank: int = 0
    ep_size: int = 1
    w13_input_scale: torch.Tensor | None = None
    w2_input_scale: torch.Tensor | None = None

    @property
    def num_local_experts(self) -> int:
        return self.w13.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.w2.shape[1]

    @property
    def intermediate_size(self) -> int:
        return self.w2.shape[2] * 2


#: 0.2's names of the same record: what the reference reads (a protocol then) and the experts it builds itself
NVFP4Experts = MoEExperts
ExpertWeights = MoEExperts


# ----------------------------------------------------------------------------------------- activations
def is_gated(activation: str) -> bool:
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown MoE activation {activation!r}; known: {', '.join(ACTIVATIONS)}")
    return activation in GATED_ACTIVATIONS


def oai_params(params: dict | None) -> tuple[float, float, float]:
    """(alpha, beta, limit) of the clamped swiglu_oai activation, defaults filled in."""
    merged = {**SWIGLU_OAI_DEFAULTS, **(params or {})}
    unknown = set(merged) - set(SWIGLU_OAI_DEFAULTS)
    if unknown:
        raise ValueError(f"unknown swiglu_oai parameters {sorted(unknown)}; known: alpha, beta, limit")
    if not merged["limit"] > 0:
        raise ValueError(f"swiglu_oai limit must be positive, got {merged['limit']}")
    return float(merged["alpha"]), float(merged["beta"]), float(merged["limit"])


def gelu_tanh(g: torch.Tensor) -> torch.Tensor:
    return 0.5 * g * (1.0 + torch.tanh(_SQRT_2_OVER_PI * (g + 0.044715 * g * g * g)))


def apply_activation(
    activation: str, gate: torch.Tensor, up: torch.Tensor | None, params: dict | None = None
) -> torch.Tensor:
    """The activation on already-scaled GEMM1 outputs, in their dtype. For relu2 ``gate`` is the whole
    (non-gated) GEMM1 output and ``up`` is None.

    * swiglu: ``silu(gate) * up``
    * geglu: ``gelu_tanh(gate) * up`` (the tanh approximation)
    * relu2: ``relu(x) ** 2``
    * swiglu_oai: ``g = min(gate, limit)``, ``u = clamp(up, -limit, limit)``,
      ``g * sigmoid(alpha * g) * (u + beta)`` (FlashInfer's parameterized SwiGLU epilogue and SGLang's
      ``swiglu_gpt_oss_sigmoid_alpha``, where beta = 1).
    """
    if not is_gated(activation):
        return torch.relu(gate).square()
    if up is None:
        raise ValueError(f"{activation} is gated and needs the up half")
    if activation == "swiglu":
        return torch.nn.functional.silu(gate) * up
    if activation == "geglu":
        return gelu_tanh(gate) * up
    alpha, beta, limit = oai_params(params)
    g = gate.clamp(max=limit)
    u = up.clamp(min=-limit, max=limit)
    return g * torch.sigmoid(alpha * g) * (u + beta)


# ----------------------------------------------------------------------------------------- routing helpers
def local_expert_offset(experts: NVFP4Experts) -> int:
    """First global expert id of this rank: ``ep_rank * num_local_experts``."""
    return experts.ep_rank * experts.num_local_experts
