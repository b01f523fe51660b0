"""W4A16 fused-MoE cases as data, and the builders that turn a case into checkpoint tensors and inputs.

A case is a seed plus sizes: every tensor is generated from ``zlib.crc32(case.id)``, so a failure
report's case id is enough to rebuild the inputs (:func:`build_global_experts`, :func:`build_inputs`).

Weights: gaussian per expert (std ``3/sqrt(H)`` for W13 so that gate values span the activations' non-
linear range and the swiglu_oai clamp at 7 is hit; ``1/sqrt(I)`` for W2), quantized with the ModelOpt
recipe; gate and up get decode scales ``base`` and ``ratio * base`` (``ratio`` 1 = tied, 2 = power of
two, 1.37 = general). Checkpoint input scales, when present, are 0.002..0.05 (a typical
``amax / (6 * 448)``): a backend that folds them into its W4A16 alphas is off by 20-500x.
Routing: ``softmax_renorm`` / ``softmax`` / ``sigmoid_bias`` from random logits (:mod:`reference_impl.
routing`), ``all_to_one`` (every token's first slot to the last expert), ``empty_experts`` (logits
biased so only a quarter of the experts can be chosen), and the inputs engines send besides router
output (contract in docs/moe.md): ``duplicate_ids`` (a token names the same expert in several slots),
``padding_ids`` (``-1`` in skipped slots, whole padded rows of ``-1``; their weights are garbage, NaN
here, and must never be read), ``all_slots_one_expert`` (every slot of every token to the last
expert), ``rank0_only`` (every token's experts on EP rank 0: the other ranks own none of them).
Activations: ``x_kind`` ``beyond_fp16`` / ``below_fp16_normal`` as in the dense cases (BF16 stays BF16).
"""
from __future__ import annotations

import functools
import zlib
from dataclasses import dataclass, replace
from typing import Literal

import torch

from reference_impl.moe import is_gated
from reference_impl.format.nvfp4 import E2M1_MAX, E4M3_MAX, quantize_modelopt
from reference_impl.moe.routing import duplicate_slots, padding_slots, route_all_to_one, sigmoid_topk_with_bias, softmax_topk  # noqa: F401

from conformance.interfaces.kernel import CaseInfo, MoEExperts
from conformance._framework.cases import WithinBound
from conformance._framework.tiers import device_for_tier

Routing = Literal[
    "softmax_renorm", "softmax", "sigmoid_bias", "all_to_one", "empty_experts",
    "duplicate_ids", "padding_ids", "all_slots_one_expert", "rank0_only",
]
MoEXKind = Literal["gaussian", "beyond_fp16", "below_fp16_normal"]
MOE_BOUND = WithinBound("conformance.moe.bounds.moe_error_bound")  # the name golden snapshots carry (still importable)
GATE_UP_RATIOS = {"tied": 1.0, "pow2": 2.0, "general": 1.37}


@dataclass(frozen=True)
class MoECase:
    """One MoE layer and one batch of tokens. ``experts`` is the global expert count; with ``ep_size`` > 1
    the layer is split over that many ranks (each checked, and their sum). ``activation_params`` is a
    tuple of (name, value) pairs (frozen)."""

    id: str
    tier: str
    tokens: int
    experts: int
    top_k: int
    hidden: int
    intermediate: int
    activation: str = "swiglu"
    activation_params: tuple[tuple[str, float], ...] = ()
    routing: Routing = "softmax_renorm"
    ep_size: int = 1
    gate_up: Literal["tied", "pow2", "general"] = "tied"
    input_scales: bool = True
    expect: WithinBound = MOE_BOUND
    x_kind: MoEXKind = "gaussian"

    def __post_init__(self) -> None:
        if self.hidden % 16 or self.intermediate % 16:
            raise ValueError(f"case {self.id}: hidden/intermediate must be multiples of 16")
        if self.experts % self.ep_size:
            raise ValueError(f"case {self.id}: {self.experts} experts do not split over {self.ep_size} ranks")
        if not 1 <= self.top_k <= self.experts:
            raise ValueError(f"case {self.id}: top_k {self.top_k} not in [1, {self.experts}]")
        is_gated(self.activation)  # validates the name

    @property
    def seed(self) -> int:
        return zlib.crc32(self.id.encode())

    @property
    def device(self) -> torch.device:
        return torch.device(device_for_tier(self.tier))

    @property
    def params(self) -> dict[str, float]:
        return dict(self.activation_params)

    @property
    def features(self) -> frozenset[str]:
        f = {self.activation, self.routing}
        f |= {f"ep{self.ep_size}"} if self.ep_size > 1 else set()
        f |= {f"untied_gate_up_{self.gate_up}"} if self.gate_up != "tied" else set()
        f |= {"input_scales"} if self.input_scales else set()
        f |= {f"x_{self.x_kind}"} if self.x_kind != "gaussian" else set()
        return frozenset(f)

    def info(self) -> CaseInfo:
        shape = dict(tokens=self.tokens, experts=self.experts, top_k=self.top_k, hidden=self.hidden,
                     intermediate=self.intermediate, ep_size=self.ep_size)
        return CaseInfo("moe", self.device, shape, self.features)


def _generator(case: MoECase, device: torch.device, stream: int) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(case.seed * 16 + stream)
    return g


def build_global_experts(case: MoECase, device: torch.device | str | None = None) -> MoEExperts:
    """All ``case.experts`` experts in checkpoint form (ep_size 1), quantized one expert at a time.
    Memoized per (case, device) -- several checks rebuild the same layer; treat the tensors as read-only."""
    device = torch.device(device) if device is not None else case.device
    return _build_global_experts(case, str(device))


@functools.lru_cache(maxsize=8)
def _build_global_experts(case: MoECase, device_name: str) -> MoEExperts:
    device = torch.device(device_name)
    g = _generator(case, device, 0)
    h, i, e = case.hidden, case.intermediate, case.experts
    gated = is_gated(case.activation)
    ratio = GATE_UP_RATIOS[case.gate_up]
    p13, s13, ss13, p2, s2, ss2 = [], [], [], [], [], []
    for _ in range(e):
        w1 = torch.randn(2 * i if gated else i, h, generator=g, device=device) * (3.0 / h**0.5)
        base = w1.abs().amax() / (E2M1_MAX * E4M3_MAX)
        halves = (w1[:i], w1[i:]) if gated else (w1,)
        scales = (base, base * ratio)[: len(halves)]
        qs = [quantize_modelopt(part, s) for part, s in zip(halves, scales)]
        p13.append(torch.cat([q.packed for q in qs]))
        s13.append(torch.cat([q.block_scale for q in qs]))
        ss13.append(torch.stack([qs[0].weight_scale_2, qs[-1].weight_scale_2]))
        q2 = quantize_modelopt(torch.randn(h, i, generator=g, device=device) * (1.0 / i**0.5))
        p2.append(q2.packed)
        s2.append(q2.block_scale)
        ss2.append(q2.weight_scale_2)
    in13 = in2 = None
    if case.input_scales:
        in13 = 0.002 + 0.048 * torch.rand(e, 2, generator=g, device=device)
        in2 = 0.002 + 0.048 * torch.rand(e, generator=g, device=device)
    return MoEExperts(
        w13=torch.stack(p13), w13_scale=torch.stack(s13), w13_scale_2=torch.stack(ss13).float(),
        w2=torch.stack(p2), w2_scale=torch.stack(s2), w2_scale_2=torch.stack(ss2).float(),
        activation=case.activation, activation_params=case.params, num_global_experts=e,
        ep_rank=0, ep_size=1, w13_input_scale=in13, w2_input_scale=in2,
    )


def rank_slice(experts: MoEExperts, rank: int, ep_size: int) -> MoEExperts:
    """Expert-parallel rank ``rank``'s experts: global ids ``[rank * E/ep, (rank + 1) * E/ep)``. Input scales
    stay global (``[num_global_experts, ...]``), as engines load them."""
    e = experts.num_local_experts
    if e % ep_size or not 0 <= rank < ep_size:
        raise ValueError(f"cannot take rank {rank} of {ep_size} from {e} experts")
    n = e // ep_size
    sl = slice(rank * n, (rank + 1) * n)
    return replace(
        experts, w13=experts.w13[sl], w13_scale=experts.w13_scale[sl], w13_scale_2=experts.w13_scale_2[sl],
        w2=experts.w2[sl], w2_scale=experts.w2_scale[sl], w2_scale_2=experts.w2_scale_2[sl],
        num_global_experts=e, ep_rank=rank, ep_size=ep_size,
    )


def build_inputs(case: MoECase, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x [T, H] bf16, topk_ids [T, k] int32, topk_weights [T, k] fp32)`` by ``case.routing``."""
    device = torch.device(device) if device is not None else case.device
    g = _generator(case, device, 1)
    x = torch.randn(case.tokens, case.hidden, generator=g, device=device)
    rows = torch.arange(case.tokens, device=device).view(-1, 1)
    if case.x_kind == "beyond_fp16":  # 3 rows of 4 beyond FP16's 65504
        x = x * torch.where(rows % 4 == 0, 1.0, 2.0**17)
    elif case.x_kind == "below_fp16_normal":  # FP16 subnormal (odd rows) and below FP16's range (even rows)
        x = x * torch.where(rows % 2 == 1, 2.0**-20, 2.0**-30)
    x = x.to(torch.bfloat16)
    logits = torch.randn(case.tokens, case.experts, generator=g, device=device)
    if case.routing == "all_to_one":
        ids, w = route_all_to_one(case.tokens, case.top_k, case.experts - 1, case.experts, device)
    elif case.routing == "all_slots_one_expert":
        ids = torch.full((case.tokens, case.top_k), case.experts - 1, dtype=torch.int32, device=device)
        w = torch.rand(case.tokens, case.top_k, generator=g, device=device)
    elif case.routing == "sigmoid_bias":
        bias = 0.5 * torch.randn(case.experts, generator=g, device=device)
        ids, w = sigmoid_topk_with_bias(logits, bias, case.top_k, renormalize=True, routed_scaling_factor=2.5)
    else:
        if case.routing == "empty_experts":  # only every 4th expert can win
            blocked = torch.arange(case.experts, device=device) % 4 != 0
            logits = logits.masked_fill(blocked, -1e4)
        if case.routing == "rank0_only":  # only the first ep rank's experts can win
            blocked = torch.arange(case.experts, device=device) >= case.experts // case.ep_size
            logits = logits.masked_fill(blocked, -1e4)
        ids, w = softmax_topk(logits, case.top_k, renormalize=case.routing != "softmax")
    if case.routing == "duplicate_ids":
        ids, w = duplicate_slots(ids, w, g)
    elif case.routing == "padding_ids":
        ids, w = padding_slots(ids, w, g)
    return x, ids, w


def _cpu_cases() -> list[MoECase]:
    c = []
    # Sizes: tokens {1, 7, 128, 515} x experts {8, 64, 256} x top-k {1, 2, 8}, not the full product;
    # small H/I on CPU, including 192 and 320 (multiples of 64, not of 128).
    c.append(MoECase("t1_e8_k1_h128_i64", "cpu", 1, 8, 1, 128, 64))
    c.append(MoECase("t7_e8_k2_h192_i192", "cpu", 7, 8, 2, 192, 192))
    c.append(MoECase("t128_e64_k8_h256_i128_softmax", "cpu", 128, 64, 8, 256, 128, routing="softmax"))
    c.append(MoECase("t515_e256_k8_h128_i64_sigmoid_bias", "cpu", 515, 256, 8, 128, 64, routing="sigmoid_bias"))
    c.append(MoECase("t515_e8_k2_h320_i64", "cpu", 515, 8, 2, 320, 64))
    c.append(MoECase("t7_e64_k1_h128_i128", "cpu", 7, 64, 1, 128, 128, routing="softmax"))
    # Activations.
    c.append(MoECase("t128_e8_k2_geglu", "cpu", 128, 8, 2, 128, 128, activation="geglu"))
    c.append(MoECase("t128_e8_k2_relu2", "cpu", 128, 8, 2, 128, 192, activation="relu2"))
    c.append(MoECase("t128_e8_k2_swiglu_oai", "cpu", 128, 8, 2, 128, 128, activation="swiglu_oai",
                     activation_params=(("alpha", 1.702), ("beta", 1.0), ("limit", 7.0))))
    # Load patterns.
    c.append(MoECase("t128_e64_k2_empty_experts", "cpu", 128, 64, 2, 128, 64, routing="empty_experts"))
    c.append(MoECase("t128_e8_k1_all_to_last", "cpu", 128, 8, 1, 128, 64, routing="all_to_one"))
    c.append(MoECase("t7_e8_k2_all_to_last", "cpu", 7, 8, 2, 128, 64, routing="all_to_one"))
    # Gate/up decode scales that differ; checkpoints without input scales.
    c.append(MoECase("t128_e8_k2_gate_up_pow2", "cpu", 128, 8, 2, 128, 128, gate_up="pow2"))
    c.append(MoECase("t128_e8_k2_gate_up_general", "cpu", 128, 8, 2, 128, 128, gate_up="general"))
    c.append(MoECase("t128_e8_k2_no_input_scales", "cpu", 128, 8, 2, 128, 64, input_scales=False))
    # Expert parallel.
    c.append(MoECase("t128_e8_k2_ep2", "cpu", 128, 8, 2, 128, 64, ep_size=2))
    c.append(MoECase("t128_e64_k8_ep4", "cpu", 128, 64, 8, 128, 64, ep_size=4, routing="softmax"))
    c.append(MoECase("t7_e8_k1_ep4_all_to_last", "cpu", 7, 8, 1, 128, 64, ep_size=4, routing="all_to_one"))
    c.append(MoECase("t515_e256_k8_ep2_relu2", "cpu", 515, 256, 8, 128, 64, ep_size=2, activation="relu2",
                     routing="sigmoid_bias"))
    # Routing inputs engines send (contract: docs/moe.md).
    c.append(MoECase("t32_e8_k2_duplicate_ids", "cpu", 32, 8, 2, 128, 64, routing="duplicate_ids"))
    c.append(MoECase("t32_e16_k4_duplicate_ids_ep2", "cpu", 32, 16, 4, 128, 64, routing="duplicate_ids", ep_size=2))
    c.append(MoECase("t32_e8_k2_padding_ids", "cpu", 32, 8, 2, 128, 64, routing="padding_ids"))
    c.append(MoECase("t64_e16_k4_padding_ids_ep4", "cpu", 64, 16, 4, 128, 64, routing="padding_ids", ep_size=4))
    c.append(MoECase("t32_e8_k4_all_slots_one_expert", "cpu", 32, 8, 4, 128, 64, routing="all_slots_one_expert"))
    c.append(MoECase("t32_e16_k2_rank0_only_ep4", "cpu", 32, 16, 2, 128, 64, routing="rank0_only", ep_size=4))
    # Activations outside FP16's range (W4A16 keeps them BF16).
    c.append(MoECase("t32_e8_k2_x_beyond_fp16", "cpu", 32, 8, 2, 128, 64, x_kind="beyond_fp16"))
    c.append(MoECase("t32_e8_k2_x_below_fp16_normal", "cpu", 32, 8, 2, 128, 64, x_kind="below_fp16_normal"))
    return c


def _cuda_cases() -> list[MoECase]:
    """Real sizes for the GPU run: 256 experts, hidden 4096, intermediate 1536 (and 1600 = 25 x 64)."""
    big = dict(experts=256, hidden=4096, intermediate=1536)
    c = []
    c.append(MoECase("cuda_t1_e256_k8_h4096_i1536", "cuda", 1, top_k=8, **big))
    c.append(MoECase("cuda_t128_e256_k8_h4096_i1536", "cuda", 128, top_k=8, **big))
    c.append(MoECase("cuda_t515_e256_k8_h4096_i1536_sigmoid_bias", "cuda", 515, top_k=8, routing="sigmoid_bias", **big))
    c.append(MoECase("cuda_t515_e256_k8_h4096_i1536_ep4", "cuda", 515, top_k=8, ep_size=4, **big))
    c.append(MoECase("cuda_t128_e256_k8_h4096_i1536_relu2", "cuda", 128, top_k=8, activation="relu2", **big))
    c.append(MoECase("cuda_t128_e256_k8_h4096_i1536_geglu", "cuda", 128, top_k=8, activation="geglu", **big))
    c.append(MoECase("cuda_t128_e256_k8_h4096_i1536_swiglu_oai", "cuda", 128, top_k=8, activation="swiglu_oai",
                     activation_params=(("alpha", 1.702), ("beta", 1.0), ("limit", 7.0)), **big))
    c.append(MoECase("cuda_t515_e256_k8_h4096_i1536_all_to_last", "cuda", 515, top_k=8, routing="all_to_one", **big))
    c.append(MoECase("cuda_t128_e256_k8_h4096_i1536_gate_up_pow2", "cuda", 128, top_k=8, gate_up="pow2", **big))
    c.append(MoECase("cuda_t7_e64_k2_h4096_i1600", "cuda", 7, 64, 2, 4096, 1600))
    c.append(MoECase("cuda_t515_e8_k2_h2880_i2880_swiglu_oai", "cuda", 515, 8, 2, 2880, 2880, activation="swiglu_oai",
                     activation_params=(("alpha", 1.702), ("beta", 1.0), ("limit", 7.0))))
    c.append(MoECase("cuda_t128_e256_k8_h4096_i1536_duplicate_ids", "cuda", 128, top_k=8, routing="duplicate_ids", **big))
    c.append(MoECase("cuda_t128_e256_k8_h4096_i1536_padding_ids_ep4", "cuda", 128, top_k=8, routing="padding_ids",
                     ep_size=4, **big))
    c.append(MoECase("cuda_t128_e256_k8_h4096_i1536_all_slots_one_expert", "cuda", 128, top_k=8,
                     routing="all_slots_one_expert", **big))
    c.append(MoECase("cuda_t128_e256_k8_h4096_i1536_x_beyond_fp16", "cuda", 128, top_k=8, x_kind="beyond_fp16", **big))
    c.append(MoECase("cuda_t128_e256_k8_h4096_i1536_x_below_fp16_normal", "cuda", 128, top_k=8,
                     x_kind="below_fp16_normal", **big))
    return c


MOE_CASES: list[MoECase] = _cpu_cases() + _cuda_cases()
