"""MoE experts as the reference reads them, and their activations: the :class:`NVFP4Experts` record (one
definition; ``conformance.interfaces.kernel.MoEExperts`` satisfies it), the concrete :class:`ExpertWeights`,
:func:`apply_activation` and the expert-parallel offset. Shared by :mod:`reference_impl.moe` (the fused-MoE
math) and :mod:`reference_impl.moe_grouped` (its grouped-GEMM evaluation), so neither imports the other's
caller."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

import torch

ACTIVATIONS = ("swiglu", "geglu", "relu2", "swiglu_oai")
GATED_ACTIVATIONS = frozenset({"swiglu", "geglu", "swiglu_oai"})
#: gpt-oss's values; SGLang hard-codes beta = 1 (``(up + 1)``), FlashInfer takes alpha/beta/limit.
SWIGLU_OAI_DEFAULTS = {"alpha": 1.702, "beta": 1.0, "limit": 7.0}
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


class NVFP4Experts(Protocol):
    """What the reference reads from a MoE layer (``conformance.interfaces.kernel.MoEExperts`` has it all)."""

    w13: torch.Tensor
    w13_scale: torch.Tensor
    w13_scale_2: torch.Tensor
    w2: torch.Tensor
    w2_scale: torch.Tensor
    w2_scale_2: torch.Tensor
    activation: str
    activation_params: dict
    ep_rank: int

    @property
    def num_local_experts(self) -> int: ...


@dataclass(frozen=True)
class ExpertWeights:
    """A concrete :class:`NVFP4Experts`: this rank's experts in checkpoint form (W13 as halves
    ``[gate; up]``, per-expert (gate, up) and down decode scales). Used wherever ``reference_impl`` builds
    experts itself (online quantization, the reference model, the FlashInfer emulator)."""

    w13: torch.Tensor
    w13_scale: torch.Tensor
    w13_scale_2: torch.Tensor
    w2: torch.Tensor
    w2_scale: torch.Tensor
    w2_scale_2: torch.Tensor
    activation: str = "swiglu"
    activation_params: dict = field(default_factory=dict)
    ep_rank: int = 0

    @property
    def num_local_experts(self) -> int:
        return self.w13.shape[0]

    @property
    def intermediate_size(self) -> int:
        return self.w2.shape[2] * 2


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
