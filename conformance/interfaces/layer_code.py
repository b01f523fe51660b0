"""The layer-code interface: an engine whose real NVFP4 layer code runs under the harness
(:mod:`conformance.engine_harness`) against the FlashInfer emulator, on any machine.

A :class:`LayerCodeEngine` builds the engine's own layer objects, feeds checkpoint tensors through the engine's
own weight loaders and post-load processing, and says which module-level names of the engine must point at the
emulator (:class:`~conformance.interfaces.standin.StandIn`). The harness runs the scenario (build, load,
forward, reload, forward) and judges what it observed. The built-ins are SGLang's
(:class:`conformance.adapters.sglang.layer_code.SGLangLayerCode`) and vLLM's (:class:`conformance.adapters.vllm.layer_code.VLLMLayerCode`); select one with ``--engine NAME|module:attr``.
Not to be confused with :class:`conformance.interfaces.rules.RulesEngine`, an engine's configuration rules.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Callable, Literal

import torch

from conformance.interfaces.standin import StandIn
from conformance.interfaces.kernel import DenseLayer, MoEExperts

Mode = Literal["w4a16", "w4a4"]
#: Fused-QKV cases use heads this wide: each shard's rows are a whole number of them.
QKV_HEAD = 32


def qkv_heads(shard_sizes: tuple[int, ...] | list[int]) -> tuple[int, int]:
    """``(query heads, key/value heads)`` of fused QKV shards ``(q_rows, k_rows, v_rows)`` of :data:`QKV_HEAD`-wide
    heads; ValueError unless each is whole heads and the key and value shards match."""
    q_rows, k_rows, v_rows = shard_sizes
    if k_rows != v_rows or q_rows % QKV_HEAD or k_rows % QKV_HEAD:
        raise ValueError(f"fused QKV shards {tuple(shard_sizes)} are not whole {QKV_HEAD}-wide heads")
    return q_rows // QKV_HEAD, k_rows // QKV_HEAD


def load_dense_shards(layer: Any, ckpt: DenseLayer, shard_ids: tuple, *, pre_quant_scale: bool = True) -> None:
    """Per fused shard, the checkpoint tensors ``weight``, ``weight_scale`` (and ``bias``) rows, ``weight_scale_2``
    and ``input_scale`` (0-d, as ModelOpt exports them) and, with ``pre_quant_scale``, ``pre_quant_scale``, fed
    through each of ``layer``'s parameters' ``weight_loader`` as the engines' model ``load_weights`` call them:
    ``loader(param, tensor, shard_id)``, or ``loader(param, tensor)`` for a shard id None (an unfused layer)."""
    start = 0
    for i, (rows, shard) in enumerate(zip(ckpt.shard_sizes, shard_ids)):
        tensors = {
            "weight": ckpt.weight[start : start + rows],
            "weight_scale": ckpt.weight_scale[start : start + rows],
            "weight_scale_2": ckpt.weight_scale_2[i].reshape(()),
        }
        if ckpt.input_scale is not None:
            tensors["input_scale"] = ckpt.input_scale[i].reshape(())
        if pre_quant_scale and ckpt.pre_quant_scale is not None:
            tensors["pre_quant_scale"] = ckpt.pre_quant_scale
        if ckpt.bias is not None:
            tensors["bias"] = ckpt.bias[start : start + rows]
        for name, t in tensors.items():
            param = getattr(layer, name)
            loader = param.weight_loader
            loader(param, t.clone(), shard) if shard is not None else loader(param, t.clone())
        start += rows


@dataclass(frozen=True)
class MoECheckpoint:
    """A MoE layer's checkpoint across all ``num_global_experts`` experts (what every EP rank's loader
    sees), and which slice this rank owns. ``gate/up/down`` are lists per global expert of
    (packed, linear block scale, weight_scale_2, input_scale)."""

    gate: tuple
    up: tuple
    down: tuple
    hidden: int
    intermediate: int
    top_k: int
    ep_rank: int
    ep_size: int

    @property
    def num_global_experts(self) -> int:
        return len(self.gate)

    @property
    def num_local_experts(self) -> int:
        return self.num_global_experts // self.ep_size

    def local_experts(self) -> MoEExperts:
        """This rank's experts in the reference's form (halves ``[gate; up]``, scales ``[E, 2]``)."""
        lo = self.ep_rank * self.num_local_experts
        sel = range(lo, lo + self.num_local_experts)
        g, u, d = ([part[e] for e in sel] for part in (self.gate, self.up, self.down))
        return MoEExperts(
            w13=torch.stack([torch.cat((gi[0], ui[0])) for gi, ui in zip(g, u)]),
            w13_scale=torch.stack([torch.cat((gi[1], ui[1])) for gi, ui in zip(g, u)]),
            w13_scale_2=torch.stack([torch.stack((gi[2], ui[2])) for gi, ui in zip(g, u)]).float(),
            w2=torch.stack([di[0] for di in d]),
            w2_scale=torch.stack([di[1] for di in d]),
            w2_scale_2=torch.stack([di[2] for di in d]).float(),
            num_global_experts=self.num_global_experts,
            ep_rank=self.ep_rank,
            ep_size=self.ep_size,
        )


@dataclass(frozen=True)
class PrefillCombine:
    """What an engine's MoE layer returned on the FlashInfer-A2A eager-prefill path
    (:attr:`LayerCodeEngine.flashinfer_a2a_prefill`): the combine input's kind (``"standard"``, ``"flashinfer"``
    or the engine's type name) and the tensor it holds."""

    combine: str
    combined: Any


class LayerCodeEngine(abc.ABC):
    """One engine under the harness. All methods run inside :meth:`stand_in` (the emulator active)."""

    name: str = "engine"

    @abc.abstractmethod
    def skip_reason(self) -> str | None:
        """``None`` when the engine can be exercised here, else why not (e.g. not installed)."""

    @abc.abstractmethod
    def stand_in(self, mode: Mode, kind: Literal["dense", "moe"], modules: dict, ckpt: Any) -> StandIn:
        """A :class:`StandIn` installing ``modules`` (the emulator's module tree, prepared by the harness)
        for ``mode``, plus the engine's own settings (env, backend selection, parallel layout for ``ckpt``)
        and patches pointing the names it bound from ``flashinfer`` at import time at ``modules``' functions."""

    def case_skip_reason(self, case: Any) -> str | None:
        """``None`` when the engine has a path for ``case`` (an engine-harness dense or MoE case), else why it
        has none (e.g. the engine has no NVFP4 AWQ method). Optional; the reason should come from asking the
        engine's own code, so a later version that adds the path runs the case."""
        return None

    # dense -------------------------------------------------------------------------------------
    @abc.abstractmethod
    def build_dense(self, ckpt: DenseLayer, mode: Mode) -> Any:
        """The engine's real linear layer for ``ckpt``'s shapes (weights created, not loaded)."""

    @abc.abstractmethod
    def load_dense(self, layer: Any, ckpt: DenseLayer) -> None:
        """Feed the checkpoint tensors through the engine's own weight loaders (per fused shard)."""

    @abc.abstractmethod
    def forward_dense(self, layer: Any, x: torch.Tensor) -> torch.Tensor: ...

    # moe ---------------------------------------------------------------------------------------
    def build_moe(self, ckpt: "MoECheckpoint", mode: Mode) -> Any:
        raise NotImplementedError(f"{self.name}: no MoE integration")

    def load_moe(self, layer: Any, ckpt: "MoECheckpoint") -> None:
        raise NotImplementedError(f"{self.name}: no MoE integration")

    def forward_moe(self, layer: Any, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(f"{self.name}: no MoE integration")

    #: Optional, the FlashInfer-A2A eager-prefill scenario (:mod:`conformance.engine_harness.a2a_prefill`): a method
    #: ``flashinfer_a2a_prefill(ckpt, mode, x, topk_ids, topk_weights, *, modules) -> PrefillCombine`` that builds,
    #: loads and post-processes the engine's MoE layer for ``ckpt`` inside :meth:`stand_in` with ``modules`` (the
    #: harness's emulator tree, which records what reaches the kernel), then runs its quant method's FlashInfer-A2A
    #: runner on a standard dispatch output of ``x``. ``None``: the engine has none (those cases skip).
    flashinfer_a2a_prefill: Callable[..., PrefillCombine] | None = None

    # shared ------------------------------------------------------------------------------------
    @abc.abstractmethod
    def post_load(self, layer: Any) -> None:
        """The engine's post-load processing (``process_weights_after_loading`` or its equivalent)."""

    @abc.abstractmethod
    def graph_captured_params(self, layer: Any) -> dict[str, torch.Tensor]:
        """The tensors a captured CUDA graph reads (prepared weights, scales, alphas): the contract says a
        same-shape reload keeps each of them the same object at the same address (docs/contracts.md section 6)."""
