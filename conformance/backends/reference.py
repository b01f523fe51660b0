"""The embedded reference backend: :mod:`reference_impl` math, CPU and CUDA."""
from __future__ import annotations

from typing import Any

import torch

import reference_impl
from reference_impl.dense import w4a16_linear

from ..adapter import Backend, DenseLayer


class ReferenceBackend(Backend):
    """FP32-accumulating pure-PyTorch W4A16 (``reference_impl``)."""

    name = "reference"

    def version(self) -> str:
        return f"reference_impl {reference_impl.__version__}, torch {torch.__version__}"

    def prepare_dense(self, layer: DenseLayer, device: torch.device) -> Any:
        return DenseLayer(*(t.to(device) if isinstance(t, torch.Tensor) else t for t in _fields(layer)))

    def run_dense(self, prepared: DenseLayer, x: torch.Tensor) -> torch.Tensor:
        return w4a16_linear(
            x,
            prepared.weight,
            prepared.weight_scale,
            prepared.weight_scale_2,
            pre_quant_scale=prepared.pre_quant_scale,
            bias=prepared.bias,
        )


def _fields(layer: DenseLayer) -> list:
    from dataclasses import fields

    return [getattr(layer, f.name) for f in fields(layer)]
