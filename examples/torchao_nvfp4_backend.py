"""Example third-party backend: torchao's ``NVFP4Tensor`` weight-only path under the conformance suite.

torchao (``pip install 'nvfp4-w4a16-conformance[torchao]'``, i.e. ``torchao>=0.18``) stores an NVFP4
weight as an ``NVFP4Tensor`` subclass; with no activation quantization configured, ``F.linear`` on it
dequantizes the weight to the activations' dtype and runs a BF16 GEMM (its "weight-only" path). That runs
wherever PyTorch does: CPU, Hopper, Blackwell. This file is the whole adapter: it hands torchao the
checkpoint bytes as they are (no requantization), so the suite checks torchao's decoding against the
contract::

    pytest conformance/ --backend examples.torchao_nvfp4_backend:TorchaoNVFP4Backend
    pytest -m perf conformance/ --backend reference,examples.torchao_nvfp4_backend:TorchaoNVFP4Backend

Mapping (checkpoint -> torchao): packed codes ``[N, K/2]`` uint8 -> ``qdata`` (same nibble order: element
2i in the low nibble); linear block scales ``[N, K/16]`` e4m3 -> ``scale`` (``is_swizzled_scales=False``);
``max(weight_scale_2)`` (the W4A16 alpha, SPEC section 2) -> ``per_tensor_scale``; ``orig_dtype`` bf16.
AWQ's ``pre_quant_scale`` is applied to the bf16 activations first (``x * pqs`` in bf16, as engines do) and
the bias goes to ``F.linear``. torchao's dequantization rounds ``e2m1 * e4m3 * weight_scale_2`` to bf16
weights, which the dense bound allows (``reference_impl/bounds/dense.py``, term 3). MoE: torchao's NVFP4 grouped GEMM
quantizes activations (W4A4) and needs Blackwell, so this adapter declares fused MoE unsupported.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from conformance.interfaces.kernel import Backend, CaseInfo, DenseLayer

EXTRA_HINT = "needs the optional extra 'torchao' (pip install 'nvfp4-w4a16-conformance[torchao]', torchao>=0.18)"


def _nvfp4_tensor_class():
    try:
        from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor
    except ImportError as exc:
        raise ImportError(f"{EXTRA_HINT}: {exc}") from exc
    return NVFP4Tensor


@dataclass(frozen=True)
class TorchaoDense:
    weight: Any  # torchao NVFP4Tensor [N, K], weight-only
    pre_quant_scale: torch.Tensor | None
    bias: torch.Tensor | None


class TorchaoNVFP4Backend(Backend):
    """torchao ``NVFP4Tensor`` weight-only linear (dequantize to bf16, BF16 GEMM)."""

    name = "torchao-nvfp4"

    def version(self) -> str:
        try:
            import torchao
        except ImportError:
            return f"torchao not installed ({EXTRA_HINT})"
        return f"torchao {torchao.__version__}, torch {torch.__version__}"

    def skip_reason(self, case: CaseInfo) -> str | None:
        try:
            _nvfp4_tensor_class()
        except ImportError:
            return EXTRA_HINT
        return None

    def prepare_dense(self, layer: DenseLayer, device: torch.device) -> TorchaoDense:
        nvfp4 = _nvfp4_tensor_class()
        weight = nvfp4(
            layer.weight.to(device).contiguous(),
            layer.weight_scale.to(device).view(torch.float8_e4m3fn).contiguous(),
            16,
            torch.bfloat16,
            per_tensor_scale=layer.weight_scale_2.to(device).float().max(),
        )
        pqs = None if layer.pre_quant_scale is None else layer.pre_quant_scale.to(device, torch.bfloat16)
        bias = None if layer.bias is None else layer.bias.to(device, torch.bfloat16)
        return TorchaoDense(weight, pqs, bias)

    def run_dense(self, prepared: TorchaoDense, x: torch.Tensor) -> torch.Tensor:
        if prepared.pre_quant_scale is not None:
            x = x * prepared.pre_quant_scale
        return torch.nn.functional.linear(x, prepared.weight, prepared.bias)

    def prepare_moe(self, experts, device):
        raise NotImplementedError("torchao's NVFP4 MoE path quantizes activations (W4A4, Blackwell only); "
                                  "no W4A16 fused MoE")
