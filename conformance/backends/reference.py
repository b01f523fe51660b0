"""The embedded reference backend: :mod:`reference_impl` math, CPU and CUDA."""
from __future__ import annotations

from dataclasses import fields, replace
from typing import Any

import torch

import reference_impl
from reference_impl.dense import w4a16_linear
from reference_impl.moe import fused_moe_w4a16

from ..adapter import Backend, DenseLayer, MoEExperts


class ReferenceBackend(Backend):
    """FP32-accumulating pure-PyTorch W4A16 (``reference_impl``)."""

    name = "reference"

    def version(self) -> str:
        return f"reference_impl {reference_impl.__version__}, torch {torch.__version__}"

    def prepare_dense(self, layer: DenseLayer, device: torch.device) -> Any:
        return _on_device(layer, device)

    def run_dense(self, prepared: DenseLayer, x: torch.Tensor) -> torch.Tensor:
        return w4a16_linear(
            x,
            prepared.weight,
            prepared.weight_scale,
            prepared.weight_scale_2,
            pre_quant_scale=prepared.pre_quant_scale,
            bias=prepared.bias,
        )

    # MoE (owned by the MoE area, issue 5): the reference fused MoE, fp32 accumulation, bf16 intermediate.
    def prepare_moe(self, experts: MoEExperts, device: torch.device) -> Any:
        return _on_device(experts, device)

    def run_moe(
        self, prepared: MoEExperts, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        return fused_moe_w4a16(x, topk_ids, topk_weights, prepared)


def _on_device(layer: DenseLayer | MoEExperts, device: torch.device):
    """The same checkpoint dataclass with every tensor field moved to ``device``."""
    moved = {f.name: getattr(layer, f.name).to(device) for f in fields(layer) if isinstance(getattr(layer, f.name), torch.Tensor)}
    return replace(layer, **moved)
