"""The embedded reference backend: :mod:`reference_impl` math, CPU and CUDA.

``prepare_*`` decodes the checkpoint weights once into bf16 (exact); ``run_*`` runs bf16 GEMMs with fp32
accumulation and fp32 epilogues (:mod:`reference_impl.dense`, :mod:`reference_impl.moe.grouped`)."""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

import torch

import reference_impl
from reference_impl.dense import PreparedLinear, prepare_w4a16_linear, run_w4a16_linear
from reference_impl.moe import check_moe_inputs
from reference_impl.moe.grouped import PreparedExperts, prepare_experts, run_prepared_experts

from conformance.interfaces.kernel import Backend, DenseLayer, MoEExperts


@dataclass(frozen=True)
class PreparedDense:
    """The checkpoint layer on the device (for derived backends and reports) and its decoded form."""

    layer: DenseLayer
    linear: PreparedLinear


@dataclass(frozen=True)
class PreparedMoE:
    experts: MoEExperts
    decoded: PreparedExperts


class ReferenceBackend(Backend):
    """FP32-accumulating pure-PyTorch W4A16 (``reference_impl``)."""

    name = "reference"

    def version(self) -> str:
        return f"reference_impl {reference_impl.__version__}, torch {torch.__version__}"

    def prepare_dense(self, layer: DenseLayer, device: torch.device) -> Any:
        layer = _on_device(layer, device)
        linear = prepare_w4a16_linear(layer.weight, layer.weight_scale, layer.weight_scale_2,
                                      pre_quant_scale=layer.pre_quant_scale, bias=layer.bias)
        return PreparedDense(layer, linear)

    def run_dense(self, prepared: PreparedDense, x: torch.Tensor) -> torch.Tensor:
        return run_w4a16_linear(prepared.linear, x)

    # MoE (owned by the MoE area, issue 5): the reference fused MoE, fp32 accumulation, bf16 intermediate.
    def prepare_moe(self, experts: MoEExperts, device: torch.device) -> Any:
        experts = _on_device(experts, device)
        return PreparedMoE(experts, prepare_experts(experts))

    def run_moe(
        self, prepared: PreparedMoE, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        check_moe_inputs(x, topk_ids, topk_weights, prepared.experts)
        return run_prepared_experts(prepared.decoded, x, topk_ids, topk_weights)


def _on_device(layer: DenseLayer | MoEExperts, device: torch.device):
    """The same checkpoint dataclass with every tensor field moved to ``device``."""
    moved = {f.name: getattr(layer, f.name).to(device) for f in fields(layer) if isinstance(getattr(layer, f.name), torch.Tensor)}
    return replace(layer, **moved)
