"""The backend adapter interface: the one class a vendor implements to put their W4A16 layer under test.

A backend is handed checkpoint tensors exactly as an NVFP4 ModelOpt checkpoint stores them (packed codes,
*linear* E4M3 block scales, decode scales ``weight_scale_2``) and must turn them into whatever its kernels
need (swizzled scales, interleaved W13, folded alphas) in ``prepare_*``. The suite then calls ``run_*``
with BF16 activations and compares the result with the reference within a derived bound.

Select a backend with ``pytest --backend module:attr`` or ``NVFP4_CONFORMANCE_BACKEND=module:attr``;
``attr`` names a :class:`Backend` subclass (or a zero-argument factory returning an instance).
The built-in backends are ``reference`` and ``flashinfer``.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from reference_impl.moe.experts import MoEActivation as _MoEActivation
from reference_impl.moe.experts import MoEExperts as _MoEExperts

Device = torch.device | str


@dataclass(frozen=True)
class DenseLayer:
    """One (possibly fused) linear layer in checkpoint form.

    ``weight`` uint8 ``[N, K/2]``; ``weight_scale`` float8_e4m3fn ``[N, K/16]`` (linear);
    ``weight_scale_2`` fp32 ``[len(shard_sizes)]``, one decode scale per fused shard (engines use the max);
    ``shard_sizes`` output rows per shard, summing to N; ``input_scale`` fp32 per shard (W4A4 only: a W4A16
    backend must ignore it); ``pre_quant_scale`` ``[K]`` (NVFP4_AWQ); ``bias`` ``[N]``."""

    weight: torch.Tensor
    weight_scale: torch.Tensor
    weight_scale_2: torch.Tensor
    shard_sizes: tuple[int, ...]
    input_scale: torch.Tensor | None = None
    pre_quant_scale: torch.Tensor | None = None
    bias: torch.Tensor | None = None

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def in_features(self) -> int:
        return self.weight.shape[1] * 2


#: The experts of one MoE layer on one rank, in checkpoint form: one record for the suite and the reference
#: (defined in :mod:`reference_impl.moe.experts`, the bottom layer, so the reference's own experts are the same type)
MoEExperts = _MoEExperts
MoEActivation = _MoEActivation


@dataclass(frozen=True)
class CaseInfo:
    """What a backend is told about a case before it runs, so it can decline it with a reason.
    ``kind`` is ``"dense"`` or ``"moe"``; ``shape`` holds the case's sizes (``m, n, k`` for dense,
    ``tokens, experts, top_k, hidden, intermediate`` for MoE); ``features`` names what it exercises
    (``bias``, ``awq``, ``fused_shards``, ``3d_input``, ``noncontiguous``, ``nonfinite``, an activation...)."""

    kind: Literal["dense", "moe"]
    device: torch.device
    shape: dict[str, int]
    features: frozenset[str] = frozenset()


class Backend(abc.ABC):
    """A W4A16 implementation under test. Subclass it, implement the ``dense`` pair (and the ``moe`` pair if
    the backend has fused MoE), and point ``--backend`` at the subclass.

    Contract: ``prepare_*`` is called once per layer; ``run_*`` may be called many times on the prepared
    object and must be deterministic (bitwise equal outputs for equal inputs); outputs are bfloat16 with the
    input's leading shape. Raise :class:`NotImplementedError` from the ``moe`` pair (the default) to declare
    MoE unsupported: those cases then skip with that reason.
    """

    #: Short name shown in test ids and reports.
    name: str = "unnamed"
    #: The hardware tier the backend needs (:mod:`conformance._framework.tiers`): a test's tier is the stricter of its
    #: case's and this one, e.g. every case run against a ``b200`` backend is a ``b200`` test, on that device.
    tier: str = "cpu"

    def version(self) -> str:
        """Version string of the implementation (library version, commit...)."""
        return "unknown"

    def skip_reason(self, case: CaseInfo) -> str | None:
        """``None`` if the case is supported, otherwise the reason it is skipped (shown to the user).
        Declining is honest; returning garbage for an unsupported shape is a failure."""
        return None

    @abc.abstractmethod
    def prepare_dense(self, layer: DenseLayer, device: torch.device) -> Any:
        """Turn checkpoint tensors into the backend's prepared form on ``device`` (called once)."""

    @abc.abstractmethod
    def run_dense(self, prepared: Any, x: torch.Tensor) -> torch.Tensor:
        """``x [..., K]`` bfloat16 (maybe non-contiguous) -> ``[..., N]`` bfloat16."""

    def prepare_moe(self, experts: MoEExperts, device: torch.device) -> Any:
        """Prepare one MoE layer's local experts (called once)."""
        raise NotImplementedError(f"backend {self.name!r} has no fused MoE")

    def run_moe(
        self, prepared: Any, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        """``x [T, H]`` bf16, ``topk_ids [T, top_k]`` int (global expert ids), ``topk_weights [T, top_k]``
        fp32 -> ``[T, H]`` bf16: the sum over this rank's experts of weight * expert(x)."""
        raise NotImplementedError(f"backend {self.name!r} has no fused MoE")
