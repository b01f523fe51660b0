"""W4A16 fused MoE: BF16 hidden states through NVFP4 experts (the contract: docs/moe.md).

For token ``t`` routed to global experts ``ids[t, :]`` with weights ``w[t, :]``, on the expert-parallel
rank owning global experts ``[offset, offset + E_local)``::

    y[t] = sum over slots k with ids[t, k] local:  w[t, k] * W2_e @ act(s_gate_e * (Wg_e @ x[t]),
                                                                     s_up_e   * (Wu_e @ x[t]))
    (relu2, non-gated: act(s_e * (W1_e @ x[t])) = relu(.)^2)

``Wg, Wu, W1, W2`` are the e2m1 codes times their E4M3 block scales (exact in fp32); the decode scales
``s_gate, s_up = w13_scale_2[e]`` (gate and up may differ) and ``s_2 = w2_scale_2[e]`` multiply the
GEMM accumulators, as the kernels' alphas do. Checkpoint input scales are never read: under W4A16 the
activations stay BF16 and input scales are neutral.

Rounding choices (what FlashInfer's CuTe DSL W4A16 kernel does, ``fused_moe/cute_dsl/blackwell/
moe_w4a16.py``): both GEMMs accumulate in fp32; GEMM1's epilogue multiplies by the alpha, applies the
activation in fp32 and stores the intermediate as **bf16** (its ``intermediate`` workspace is bf16), which
GEMM2 reads. The fp32 reference therefore rounds the intermediate to bf16 too, so it runs GEMM2 on the
same kind of input as the kernel. The kernel also rounds each expert's output row to bf16 before the
weighted combine; the reference does not (it keeps fp32 until the final bf16 cast) -- the error bound
(``reference_impl/bounds/moe.py``) covers both. ``accum_dtype=torch.float64`` gives the exact value of the
dequantized model (fp64, no intermediate rounding): the value error bounds are measured from.

Evaluation: with fp32 accumulation (the default) the experts run as grouped GEMMs with fp32 accumulators
(:mod:`reference_impl.moe.grouped`: bf16 GEMMs with fp32 output on CUDA; on CPU the exact sum of the exact
products rounded once to fp32, :mod:`reference_impl.dense.exact_dot`); a one-shot call decodes only the experts
that receive tokens, a backend prepares all of its experts once. The fp64 evaluation visits the experts
with tokens one at a time, its GEMMs are :func:`reference_impl.dense.exact_dot.exact_matmul` (exact per slice,
slices added in a fixed order), and each token's slot contributions are added in slot order. Both are
deterministic by construction: no result depends on a BLAS's summation order, the thread count or the load
(see docs/moe.md, "Determinism"). Ids outside this rank's range (other ranks' experts, or negative padding
ids) contribute nothing.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from reference_impl.dense.exact_dot import exact_matmul
from reference_impl.moe.experts import (  # noqa: F401 - public here since 0.1
    ACTIVATIONS,
    GATED_ACTIVATIONS,
    SWIGLU_OAI_DEFAULTS,
    NVFP4Experts,
    ExpertWeights,
    is_gated,
    oai_params,
    gelu_tanh,
    apply_activation,
    local_expert_offset,
)
from reference_impl.format.nvfp4 import BLOCK_SIZE, codes_times_block_scales

@dataclass(frozen=True)
class ExpertBatch:
    """The (token, slot) pairs routed to one local expert."""

    local_expert: int
    tokens: torch.Tensor  # [n] int64 token indices
    slots: torch.Tensor  # [n] int64 top-k slot indices


def expert_batches(topk_ids: torch.Tensor, offset: int, num_local_experts: int) -> list[ExpertBatch]:
    """Group (token, slot) pairs by local expert; experts without tokens are left out."""
    local = topk_ids.long() - offset
    owned = (local >= 0) & (local < num_local_experts)
    tok, slot = torch.nonzero(owned, as_tuple=True)
    if tok.numel() == 0:
        return []
    exp = local[tok, slot]
    order = torch.argsort(exp, stable=True)
    tok, slot, exp = tok[order], slot[order], exp[order]
    uniq, counts = torch.unique_consecutive(exp, return_counts=True)
    batches, start = [], 0
    for e, n in zip(uniq.tolist(), counts.tolist()):
        batches.append(ExpertBatch(e, tok[start : start + n], slot[start : start + n]))
        start += n
    return batches


# ----------------------------------------------------------------------------------------- weights
@dataclass(frozen=True)
class DequantizedExpert:
    """One expert's weights as codes * block scales (decode scales NOT applied), and its decode scales.
    ``up`` is None for non-gated activations (then ``gate`` is the whole W1)."""

    gate: torch.Tensor  # [I, H]
    up: torch.Tensor | None  # [I, H]
    down: torch.Tensor  # [H, I]
    scale_gate: torch.Tensor  # 0-d
    scale_up: torch.Tensor  # 0-d
    scale_down: torch.Tensor  # 0-d


def dequantize_expert(experts: NVFP4Experts, e: int, dtype: torch.dtype = torch.float32) -> DequantizedExpert:
    """Local expert ``e``: gate/up/down as e2m1 * e4m3 (exact in bf16, fp32 and fp64) plus its decode scales."""
    w13 = codes_times_block_scales(experts.w13[e], experts.w13_scale[e]).to(dtype)
    down = codes_times_block_scales(experts.w2[e], experts.w2_scale[e]).to(dtype)
    s13 = experts.w13_scale_2[e].to(dtype).reshape(-1)
    s2 = experts.w2_scale_2[e].to(dtype).reshape(())
    if is_gated(experts.activation):
        half = w13.shape[0] // 2
        return DequantizedExpert(w13[:half], w13[half:], down, s13[0], s13[-1], s2)
    return DequantizedExpert(w13, None, down, s13[0], s13[0], s2)


def check_moe_inputs(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, experts: NVFP4Experts) -> None:
    """Raise ``TypeError``/``ValueError`` with a readable message for inputs that do not fit."""
    if x.dtype != torch.bfloat16 or x.dim() != 2:
        raise TypeError(f"W4A16 MoE hidden states must be a 2-D bfloat16 tensor, got {x.dtype} {tuple(x.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk_ids must be [tokens={x.shape[0]}, top_k], got {tuple(topk_ids.shape)}")
    if topk_ids.dtype.is_floating_point or topk_ids.dtype == torch.bool:
        raise TypeError(f"topk_ids must be integer, got {topk_ids.dtype}")
    if topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_weights shape {tuple(topk_weights.shape)} != topk_ids shape {tuple(topk_ids.shape)}")
    if experts.w13.dtype != torch.uint8 or experts.w2.dtype != torch.uint8:
        raise TypeError(f"packed expert weights must be uint8, got w13 {experts.w13.dtype}, w2 {experts.w2.dtype}")
    e, hidden, inter = experts.w2.shape[0], experts.w2.shape[1], experts.w2.shape[2] * 2
    rows13 = 2 * inter if is_gated(experts.activation) else inter
    if experts.w13.shape != (e, rows13, hidden // 2):
        raise ValueError(
            f"w13 shape {tuple(experts.w13.shape)} != ({e}, {rows13}, {hidden // 2}) for {experts.activation} "
            f"with hidden {hidden}, intermediate {inter} (w13 must be halves [gate; up] for gated activations)"
        )
    if x.shape[1] != hidden:
        raise ValueError(f"hidden size of x ({x.shape[1]}) != experts' hidden size ({hidden})")
    if experts.w13_scale.shape != (e, rows13, hidden // BLOCK_SIZE):
        raise ValueError(f"w13 block scale shape {tuple(experts.w13_scale.shape)} != ({e}, {rows13}, {hidden // BLOCK_SIZE})")
    if experts.w2_scale.shape != (e, hidden, inter // BLOCK_SIZE):
        raise ValueError(f"w2 block scale shape {tuple(experts.w2_scale.shape)} != ({e}, {hidden}, {inter // BLOCK_SIZE})")
    if experts.w13_scale_2.shape[0] != e or experts.w2_scale_2.reshape(-1).shape[0] != e:
        raise ValueError(
            f"decode scales must have one entry per local expert ({e}): w13_scale_2 {tuple(experts.w13_scale_2.shape)}, "
            f"w2_scale_2 {tuple(experts.w2_scale_2.shape)}"
        )


# ----------------------------------------------------------------------------------------- the MoE
def fused_moe_w4a16(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    experts: NVFP4Experts,
    *,
    accum_dtype: torch.dtype = torch.float32,
    round_intermediate: bool | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    expert_order: list[int] | None = None,
    expert_cache: dict | None = None,
) -> torch.Tensor:
    """The reference W4A16 fused MoE on this rank's experts. ``x [T, H]`` bf16, ``topk_ids [T, k]`` global
    ids, ``topk_weights [T, k]``. ``round_intermediate`` defaults to True for fp32 (the kernel's bf16
    intermediate) and False for fp64 (the exact value). ``expert_order`` visits local experts in another
    order (for self-tests of order independence). ``expert_cache``: a dict the caller owns and empties when
    the weights change, in which decoded experts are kept across calls (the same values
    :func:`dequantize_expert` gives at each call; a caller decoding every step of a generation would otherwise
    decode every expert again each time); ignored by the fp32 path, which decodes in :mod:`.moe_grouped`."""
    check_moe_inputs(x, topk_ids, topk_weights, experts)
    if round_intermediate is None:
        round_intermediate = accum_dtype != torch.float64
    if accum_dtype == torch.float32:  # bf16 grouped GEMMs, fp32 accumulation: reference_impl.moe.grouped
        from reference_impl.moe.grouped import prepare_experts, routed_local_experts, run_prepared_experts

        active = routed_local_experts(topk_ids.to(x.device), experts)
        if expert_order is not None:  # no numeric effect there (the combine sums slots in a fixed order)
            rank = {e: i for i, e in enumerate(expert_order)}
            active = sorted(active, key=lambda e: rank[e])
        prepared = prepare_experts(experts, active)
        return run_prepared_experts(prepared, x, topk_ids, topk_weights, out_dtype=out_dtype,
                                    round_intermediate=round_intermediate)
    xa = x.to(accum_dtype)
    # One row per (token, slot), each written by the one expert it is routed to, then added in slot order:
    # no accumulation order to choose (index_add_ would add in whatever order the device picks).
    rows = torch.zeros(x.shape[0], topk_ids.shape[1], x.shape[1], dtype=accum_dtype, device=x.device)
    matmul = exact_matmul if accum_dtype == torch.float64 else _plain_matmul
    batches = expert_batches(topk_ids.to(x.device), local_expert_offset(experts), experts.num_local_experts)
    if expert_order is not None:
        rank = {e: i for i, e in enumerate(expert_order)}
        batches.sort(key=lambda b: rank[b.local_expert])
    weights = topk_weights.to(device=x.device, dtype=accum_dtype)
    for batch in batches:
        w = _decoded_expert(experts, batch.local_expert, accum_dtype, expert_cache)
        xt = xa[batch.tokens]
        gate = matmul(xt, w.gate) * w.scale_gate
        up = matmul(xt, w.up) * w.scale_up if w.up is not None else None
        h = apply_activation(experts.activation, gate, up, experts.activation_params)
        if round_intermediate:
            h = h.to(torch.bfloat16).to(accum_dtype)
        o = matmul(h, w.down) * w.scale_down
        rows[batch.tokens, batch.slots] = o * weights[batch.tokens, batch.slots].unsqueeze(-1)
        del w, gate, up, h, o
    out = rows[:, 0].clone()
    for slot in range(1, rows.shape[1]):
        out += rows[:, slot]
    return out.to(out_dtype)


def _decoded_expert(experts: NVFP4Experts, local_expert: int, dtype: torch.dtype, cache: dict | None):
    """:func:`dequantize_expert`, kept in ``cache`` (keyed by expert and dtype) when the caller gives one."""
    key = (local_expert, dtype)
    w = cache.get(key) if cache is not None else None
    if w is None:
        w = dequantize_expert(experts, local_expert, dtype)
        if cache is not None:
            cache[key] = w
    return w


def _plain_matmul(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return a @ w.T


def fused_moe_exact(x, topk_ids, topk_weights, experts) -> torch.Tensor:
    """The exact value (fp64, no intermediate rounding) as float64 ``[T, H]``."""
    return fused_moe_w4a16(x, topk_ids, topk_weights, experts, accum_dtype=torch.float64, out_dtype=torch.float64)
