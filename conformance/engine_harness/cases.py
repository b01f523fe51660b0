"""Engine-integration cases as data: which checkpoint goes through which engine path.

Dense cases reuse :class:`conformance._framework.dense_layers.DenseCase` for the checkpoint (each fused shard
quantized on its own, so fused QKV carries different ``weight_scale_2`` per shard, and every layer
carries a W4A4 ``input_scale`` far from 1, so an alpha that wrongly includes it is visible). MoE cases
quantize every global expert's gate, up and down projection with the ModelOpt recipe; input scales are
present and deliberately not 1 (neutral under W4A16).
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch

from reference_impl.format.nvfp4 import E2M1_MAX, E4M3_MAX, quantize_modelopt

from conformance._framework.dense_layers import DenseCase
from conformance.engine_harness.core import MoECheckpoint, Mode


@dataclass(frozen=True)
class EngineDenseCase:
    id: str
    mode: Mode
    dense: DenseCase
    tier: str = "cpu"


@dataclass(frozen=True)
class EngineMoECase:
    """``gate_up_gain`` scales the up projection relative to the gate one: 1.0 gives (nearly) equal
    ``weight_scale_2`` for gate and up; anything else makes them differ."""

    id: str
    num_experts: int
    hidden: int
    intermediate: int
    tokens: int
    top_k: int
    ep_size: int = 1
    ep_rank: int = 0
    gate_up_gain: float = 1.0
    shared_gate_up_scale: bool = True
    mode: Mode = "w4a16"
    tier: str = "cpu"

    @property
    def seed(self) -> int:
        return zlib.crc32(self.id.encode())


def _dense(id_: str, **kw) -> DenseCase:
    return DenseCase(id_, "cpu", kw.pop("m_shape", (5,)), kw.pop("n", 192), kw.pop("k", 128), **kw)


_QKV = ((128, 0.25), (32, 1.0), (32, 0.5))  # q: 4 heads x 32, k and v: 1 head x 32
DENSE_CASES = [
    EngineDenseCase("dense-w4a16-plain", "w4a16", _dense("engine-plain")),
    EngineDenseCase("dense-w4a16-awq", "w4a16", _dense("engine-awq", awq=True)),
    EngineDenseCase("dense-w4a16-fused-qkv", "w4a16", _dense("engine-qkv", shards=_QKV)),
    EngineDenseCase("dense-w4a16-3d-input", "w4a16", _dense("engine-3d", m_shape=(2, 3), n=128, k=64)),
    EngineDenseCase("dense-w4a4-plain", "w4a4", _dense("engine-w4a4-plain")),
    EngineDenseCase("dense-w4a4-fused-qkv", "w4a4", _dense("engine-w4a4-qkv", shards=_QKV)),
    EngineDenseCase("dense-w4a4-awq", "w4a4", _dense("engine-w4a4-awq", awq=True)),
]

MOE_CASES = [
    EngineMoECase("moe-w4a16-4-experts", num_experts=4, hidden=128, intermediate=128, tokens=9, top_k=2),
    EngineMoECase("moe-w4a16-ep-rank1-of-2", num_experts=4, hidden=128, intermediate=128, tokens=11, top_k=2,
                  ep_size=2, ep_rank=1),
    EngineMoECase("moe-w4a16-gate-up-scales-differ", num_experts=3, hidden=128, intermediate=128, tokens=7,
                  top_k=2, gate_up_gain=4.0, shared_gate_up_scale=False),
]


def _quantize(w: torch.Tensor, ws2: torch.Tensor | None, input_amax: float) -> tuple:
    q = quantize_modelopt(w, ws2)
    return q.packed, q.block_scale, q.weight_scale_2.reshape(()), torch.tensor(input_amax / (E2M1_MAX * E4M3_MAX))


def build_moe_checkpoint(case: EngineMoECase) -> MoECheckpoint:
    """Every global expert's (packed, linear scales, weight_scale_2, input_scale) for gate, up and down.
    With ``shared_gate_up_scale`` gate and up are quantized with one ``weight_scale_2`` (what ModelOpt
    exports for fused gate/up); otherwise each with its own amax."""
    g = torch.Generator().manual_seed(case.seed)
    gate, up, down = [], [], []
    for e in range(case.num_experts):
        wg = torch.randn(case.intermediate, case.hidden, generator=g) / case.hidden**0.5
        wu = torch.randn(case.intermediate, case.hidden, generator=g) * case.gate_up_gain / case.hidden**0.5
        wd = torch.randn(case.hidden, case.intermediate, generator=g) / case.intermediate**0.5
        shared = torch.maximum(wg.abs().max(), wu.abs().max()) / (E2M1_MAX * E4M3_MAX)
        gate.append(_quantize(wg, shared if case.shared_gate_up_scale else None, 6.0 + e))
        up.append(_quantize(wu, shared if case.shared_gate_up_scale else None, 6.0 + e))
        down.append(_quantize(wd, None, 3.0 + e))
    return MoECheckpoint(tuple(gate), tuple(up), tuple(down), case.hidden, case.intermediate, case.top_k,
                         case.ep_rank, case.ep_size)


def build_moe_inputs(case: EngineMoECase) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Hidden states ``[T, H]`` bf16, top-k global expert ids (int32, distinct per token) and softmax weights."""
    g = torch.Generator().manual_seed(case.seed + 1)
    x = torch.randn(case.tokens, case.hidden, generator=g).bfloat16()
    logits = torch.randn(case.tokens, case.num_experts, generator=g)
    weights, ids = torch.topk(torch.softmax(logits, -1), case.top_k, dim=-1)
    return x, ids.to(torch.int32), (weights / weights.sum(-1, keepdim=True)).float()
