"""The correct, readable dense W4A16 layer the mutants (tests/dense/mutants.py) and the correct variants
(tests/dense/variants.py) are built from, and the layer helpers they share.

:class:`PlainDense`'s hooks mirror the stages of a real kernel: prepare the weight, decode it, pick alpha, pre-scale
the activations, GEMM, epilogue.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from conformance.interfaces.kernel import Backend, DenseLayer
from reference_impl.format.nvfp4 import BLOCK_SIZE, e2m1_decode, e4m3_decode, unpack_nibbles


class PlainDense(Backend):
    """A correct, readable W4A16 layer split into overridable stages (fp32 throughout, bf16 output)."""

    name = "PlainDense"
    caught_by: str | None = None  # the named check expected to reject a mutant; None for correct ones
    #: the diagnosis rule(s) (conformance.dense.diagnosis.RULES) or cross-case pattern(s) (PATTERNS) its failures
    #: must show
    diagnosed_as: str | tuple[str, ...] | None = None

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.name = cls.__name__  # test ids and reports name the planted bug

    def prepare_dense(self, layer: DenseLayer, device: torch.device) -> Any:
        return layer

    def decode_weight(self, layer: DenseLayer) -> torch.Tensor:
        """``e2m1 * e4m3`` as fp32 ``[N, K]`` (exact)."""
        codes = unpack_nibbles(layer.weight)
        return e2m1_decode(codes) * e4m3_decode(layer.weight_scale).repeat_interleave(BLOCK_SIZE, dim=-1)

    def alpha(self, layer: DenseLayer) -> torch.Tensor:
        return layer.weight_scale_2.float().max()

    def prescale(self, x: torch.Tensor, layer: DenseLayer) -> torch.Tensor:
        x = x.reshape(-1, x.shape[-1]).float()
        return x if layer.pre_quant_scale is None else x * layer.pre_quant_scale.float()

    def gemm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x @ w.T

    def scaled(self, acc: torch.Tensor, layer: DenseLayer) -> torch.Tensor:
        """The fp32 accumulator times alpha, plus the bias (fp32): the epilogue before its rounding to bf16."""
        out = acc * self.alpha(layer)
        return out if layer.bias is None else out + layer.bias.float()

    def epilogue(self, acc: torch.Tensor, layer: DenseLayer) -> torch.Tensor:
        return self.scaled(acc, layer).bfloat16()

    def run_dense(self, prepared: DenseLayer, x: torch.Tensor) -> torch.Tensor:
        acc = self.gemm(self.prescale(x, prepared), self.decode_weight(prepared))
        return self.epilogue(acc, prepared).reshape(*x.shape[:-1], prepared.out_features)



def rest(layer: DenseLayer) -> tuple:
    """The layer's fields after the weight, in :class:`DenseLayer`'s order."""
    return (layer.weight_scale, layer.weight_scale_2, layer.shard_sizes, layer.input_scale,
            layer.pre_quant_scale, layer.bias)


def with_(layer: DenseLayer, **changes) -> DenseLayer:
    """A copy of the layer with ``changes``."""
    return replace(layer, **changes)
