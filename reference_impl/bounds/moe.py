"""Derived per-element error bounds for the W4A16 fused MoE (docs/contracts.md section 3).

The bound is measured from the exact value ``y`` of the dequantized model (``reference_impl.moe.
fused_moe_exact``: fp64, exact activation, no intermediate rounding) and covers any implementation that
does what the FlashInfer CuTe DSL W4A16 kernel does, in any expert/token order:

Notation, for a token ``t`` routed to local expert ``e`` with routing weight ``w``. ``Wg, Wu, W2`` are
codes times block scales (bf16/fp32-exact), ``s_g, s_u, s_2`` the decode scales, ``u32 = 2^-24``,
``u_bf = 2^-8`` (bf16 has 8 significant bits), ``gamma(n) = n*u_acc / (1 - n*u_acc)`` with
``u_acc = 2^-23``: one fp32 ulp per addition, so accumulators that truncate instead of rounding
(tensor cores) are covered too.

1. GEMM1. The products ``x_h * W_ih`` are exact in fp32 (bf16 x 5-bit values), so only the H additions
   and the alpha multiply round:
   ``|g^ - g| <= dg = s_g * gamma(H+1) * sum_h |x_h| |Wg_ih|`` (same for up).
   Unlike the dense bound (``reference_impl/bounds/dense.py`` term 3) there is no allowance for rounding
   ``e2m1 * e4m3 * weight_scale_2`` to bf16 weights: the MoE contract (FlashInfer's kernel, SGLang's
   runner) keeps ``e2m1 * e4m3`` exact and applies the decode scales as per-expert alphas. Two stacked
   GEMMs amplify such an allowance by ``sum|W2| sum|W1|`` (it would make the bound ~80% of ``|y|`` at
   H=128, I=64), so a Marlin-style "scaled bf16 weights" MoE is out of this bound's scope.
2. Activation, propagated with finite-difference (mean value) bounds, not first-order guesses:
   swiglu  ``|silu(g^)u^ - silu(g)u| <= L_silu dg (|u| + du) + |silu(g)| du``, ``L_silu = 1.1``
   (``sup |silu'| = 1.09984``); geglu the same with ``L_gelu = 1.13`` (``sup |gelu_tanh'| = 1.12899``);
   swiglu_oai: the clamps are 1-Lipschitz and ``g sigmoid(alpha g)`` has the Lipschitz constant of silu,
   so the same form with ``|u_c + beta|`` and ``|glu(g_c)|``; relu2 ``|relu(v^)^2 - relu(v)^2| <=
   dv (2|v| + dv)``.
   Evaluation error of the fp32 epilogue (``ex2.approx``, ``rcp.approx``, tanh through the sigmoid,
   three roundings): ``<= 2^-18 (|g| + dg)(|u| + du)`` (relu2: ``2^-22 (|v| + dv)^2``); the approximate
   sigmoid's absolute error is below 2^-20 and ``|g sigmoid'| <= 0.28``, so 2^-18 has margin.
3. The intermediate is stored as bf16: ``+ u_bf (|h| + dh_pre)``. Result: ``dh`` per element.
4. GEMM2 on the rounded intermediate: ``|o^ - o| <= do = s_2 (sum_i |W2_ji| dh_i + gamma(I+1) sum_i
   |W2_ji| (|h_i| + dh_i))``.
5. Routing-weighted combine. Each contribution ``w * o^`` may be rounded to bf16 (the kernel's expert
   output rows / fused-finalize values): ``dc = |w| do + (u_bf + 2^-20) |w| (|o| + do)``. The sum of the
   ``n`` local contributions may be accumulated in bf16 in any order (fused finalize uses bf16 atomics):
   ``+ gamma_bf(n) * sum |c^|`` with ``gamma_bf(n) = n u_bf / (1 - n u_bf)``, then the final bf16 cast
   ``+ u_bf (|y| + everything above)``.
6. An absolute floor of 2^-100 per element covers subnormal flushes (``.ftz`` ops), far below any signal.

Per element: ``bound = sum_k dc_k + gamma_bf(n) sum_k |c^_k| + u_bf (|y| + ...) + 2^-100``.
It is a worst case, and two stacked GEMMs compound worst cases: GEMM1's ``gamma(H+1) sum|x||W1|`` error is
carried through ``sum_i |W2_ji|``, and the bf16 intermediate's rounding through the same sum (which exceeds
``|o_j|`` by about ``sqrt(I)`` for random signs). Measured with the suite's weights (``||bound|| / ||y||``):
~4% at H=128, I=64; ~5% at H=192, I=192; ~14% at H=256, I=128, top-8; but ~170% at H=4096, I=1536
(GEMM1's accumulation term alone is ~95% of it; without it ~10%). So at real sizes this bound is NOT
discriminating by itself; there the summary figures rel L2 < 2e-2 and cosine > 0.999 (the acceptance of
FlashInfer's dense W4A16 GEMM test, tests/gemm/test_mm_bf16_fp4.py; asserted by ``check_moe_summary_figures``)
carry the rejection of structural bugs (their errors are O(1) relative),
and ``bound_ratio`` is recorded. Real errors are ~2.3e-3 relative (rel L2) at every size measured.
A probabilistic (Higham-Mary, ``lambda sqrt(n) u``) GEMM1 term would be ~8x tighter but assumes
mean-zero rounding, which truncating tensor-core adders do not guarantee: not adopted.
Expert parallel: each rank's bound covers its own output; the bound of the sum over ranks (summed in
fp64) is the sum of the ranks' bounds.

:func:`quantization_error_bound` and :func:`weight_perturbation_bound` bound the difference between the
NVFP4 model and the BF16 model it was quantized from (online quantization).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from reference_impl.moe import (
    NVFP4Experts,
    apply_activation,
    check_moe_inputs,
    dequantize_expert,
    expert_batches,
    is_gated,
    local_expert_offset,
    oai_params,
)

from reference_impl.bounds.dense import U_ACCUM as U_ACC  # one fp32 ulp per addition (tensor cores truncate)
from reference_impl.bounds.dense import U_BF16, ErrorFigures, error_figures, gamma  # noqa: F401 - re-exported

L_SILU = 1.1
L_GELU = 1.13
EVAL_GATED = 2.0**-18
EVAL_RELU2 = 2.0**-22
CONTRIB_ROUNDING = U_BF16 + 2.0**-20
ABS_FLOOR = 2.0**-100
FP64_REL = 2.0**-40


def activation_perturbation(
    activation: str, g: torch.Tensor, u: torch.Tensor | None, dg: torch.Tensor, du: torch.Tensor | None, params=None
) -> torch.Tensor:
    """Bound on ``|act(g', u') - act(g, u)|`` for ``|g' - g| <= dg``, ``|u' - u| <= du`` (fp64, elementwise)."""
    if not is_gated(activation):
        return dg * (2 * g.abs() + dg)
    if activation == "swiglu":
        lip, gate_val, up_abs = L_SILU, torch.nn.functional.silu(g).abs(), u.abs()
    elif activation == "geglu":
        from reference_impl.moe import gelu_tanh

        lip, gate_val, up_abs = L_GELU, gelu_tanh(g).abs(), u.abs()
    else:
        alpha, beta, limit = oai_params(params)
        gc = g.clamp(max=limit)
        lip = L_SILU
        gate_val = (gc * torch.sigmoid(alpha * gc)).abs()
        up_abs = (u.clamp(-limit, limit) + beta).abs()
    return lip * dg * (up_abs + du) + gate_val * du


def activation_evaluation_error(activation: str, g, u, dg, du, params=None) -> torch.Tensor:
    """Bound on the fp32 epilogue's own evaluation error at the computed inputs (item 2 above)."""
    if not is_gated(activation):
        return EVAL_RELU2 * (g.abs() + dg).square()
    if activation == "swiglu_oai":
        _, beta, _ = oai_params(params)
        return EVAL_GATED * (g.abs() + dg) * (u.abs() + abs(beta) + du)
    return EVAL_GATED * (g.abs() + dg) * (u.abs() + du)


@dataclass(frozen=True)
class MoEBound:
    """``exact`` fp64 ``[T, H]`` and the per-element ``bound`` on ``|backend - exact|``."""

    exact: torch.Tensor
    bound: torch.Tensor


def moe_error_bound(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, experts: NVFP4Experts) -> MoEBound:
    """The exact MoE output of this rank and its per-element error bound (module docstring), in fp64."""
    check_moe_inputs(x, topk_ids, topk_weights, experts)
    f64 = torch.float64
    xa = x.to(f64)
    t, hidden = x.shape
    inter = experts.intermediate_size if hasattr(experts, "intermediate_size") else experts.w2.shape[2] * 2
    y = torch.zeros(t, hidden, dtype=f64, device=x.device)
    sum_dc = torch.zeros_like(y)
    sum_c = torch.zeros_like(y)
    n_local = torch.zeros(t, 1, dtype=f64, device=x.device)
    weights = topk_weights.to(device=x.device, dtype=f64)
    g1, g2 = gamma(hidden + 1), gamma(inter + 1)
    act, params = experts.activation, experts.activation_params
    for batch in expert_batches(topk_ids.to(x.device), local_expert_offset(experts), experts.num_local_experts):
        w = dequantize_expert(experts, batch.local_expert, f64)
        xt = xa[batch.tokens]
        ax = xt.abs()
        g = (xt @ w.gate.T) * w.scale_gate
        dg = w.scale_gate.abs() * g1 * (ax @ w.gate.abs().T)
        if w.up is not None:
            u = (xt @ w.up.T) * w.scale_up
            du = w.scale_up.abs() * g1 * (ax @ w.up.abs().T)
        else:
            u = du = None
        h = apply_activation(act, g, u, params)
        dh_pre = activation_perturbation(act, g, u, dg, du, params) + activation_evaluation_error(act, g, u, dg, du, params)
        dh = dh_pre + U_BF16 * (h.abs() + dh_pre)
        del g, u, dg, du, dh_pre
        w2abs = w.down.abs()
        o = (h @ w.down.T) * w.scale_down
        do = w.scale_down.abs() * (dh @ w2abs.T + g2 * ((h.abs() + dh) @ w2abs.T))
        rw = weights[batch.tokens, batch.slots].unsqueeze(-1)
        o_abs = o.abs() + do
        y.index_add_(0, batch.tokens, rw * o)
        sum_dc.index_add_(0, batch.tokens, rw.abs() * (do + CONTRIB_ROUNDING * o_abs))
        sum_c.index_add_(0, batch.tokens, rw.abs() * o_abs * (1 + CONTRIB_ROUNDING))
        n_local.index_add_(0, batch.tokens, torch.ones(batch.tokens.numel(), 1, dtype=f64, device=x.device))
        del w, h, dh, o, do, o_abs
    combine = gamma(n_local, U_BF16) * sum_c
    pre_final = sum_dc + combine
    bound = pre_final + U_BF16 * (y.abs() + pre_final) + ABS_FLOOR
    return MoEBound(y, bound)


# ----------------------------------------------------------------------------------------- quantization
def quantization_error_bound(w: torch.Tensor, decode_block_scale: torch.Tensor) -> torch.Tensor:
    """Per-element bound on ``|w - deq(q(w))|`` for ANY recipe that rounds ``w / s`` to the nearest E2M1
    value (saturating) at the block's decode scale ``s = e4m3 * weight_scale_2`` (``[..., K/16]``):
    inside the E2M1 range the largest half-step is 1 (between 4 and 6), so the error is ``<= s``;
    beyond 6 (the E4M3 scale rounded down, or a subnormal scale) the value saturates to ``6 s`` and the
    error is ``|w| - 6 s``; a zero scale gives ``|w|``. Hence ``max(s, |w| - 6 s)``. This is "half an
    E2M1 step times the block scale, plus the scale's own rounding" made exact for every recipe
    (ModelOpt's, FlashInfer's kernel recipe, 4over6)."""
    s = decode_block_scale.to(torch.float64).repeat_interleave(16, dim=-1)
    wa = w.to(torch.float64).abs()
    return torch.maximum(s, wa - 6 * s)


E4M3_REL = 2.0**-4  # E4M3 has 4 significant bits: round-to-nearest moves a normal value by <= 2^-4
E4M3_SUBNORMAL_HALF_STEP = 2.0**-10  # half of the subnormal spacing 2^-9


def recipe_independent_error_bound(w: torch.Tensor, amax: torch.Tensor | float | None = None) -> torch.Tensor:
    """Per-element bound on ``|w - deq(q(w))|`` computed from ``w`` alone (not trusting stored scales), for
    any recipe that uses ``weight_scale_2 = amax / (6 * 448)`` and per block a decode scale
    ``s = e4m3(c * s_hp / ws2) * ws2`` with ``s_hp = amax_block / 6`` and ``c`` in {1, 1.5} (the standard
    recipe and 4over6's "max to 4" candidate), then rounds to nearest E2M1. E4M3 rounding moves the scale
    by <= 2^-4 relative (normal) or 2^-10 absolute (subnormal), so ``s`` lies in
    ``[s_lo, s_hi] = [s_hp (1 - 2^-4) - 2^-10 ws2, 1.5 s_hp (1 + 2^-4) + 2^-10 ws2]``, and by the argument of
    :func:`quantization_error_bound` the error is ``<= max(s_hi, |w| - 6 s_lo)``. ``amax`` defaults to
    ``max |w|``; pass the shared amax when several tensors were quantized together (gate + up)."""
    wd = w.to(torch.float64)
    amax = wd.abs().max() if amax is None else torch.as_tensor(amax, dtype=torch.float64)
    ws2 = amax / (6 * 448)
    s_hp = wd.abs().reshape(*wd.shape[:-1], -1, 16).amax(-1) / 6
    s_hi = 1.5 * s_hp * (1 + E4M3_REL) + E4M3_SUBNORMAL_HALF_STEP * ws2
    s_lo = (s_hp * (1 - E4M3_REL) - E4M3_SUBNORMAL_HALF_STEP * ws2).clamp_min(0)
    s_hi, s_lo = s_hi.repeat_interleave(16, dim=-1), s_lo.repeat_interleave(16, dim=-1)
    return torch.maximum(s_hi, wd.abs() - 6 * s_lo)


def weight_perturbation_bound(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13_hp: torch.Tensor,
    w2_hp: torch.Tensor,
    experts: NVFP4Experts,
) -> MoEBound:
    """Exact (fp64) output of the high-precision model (``w13_hp [E, 2I, H]`` halves ``[gate; up]``,
    ``w2_hp [E, H, I]``) and a bound on ``|MoE_exact(quantized experts) - MoE_exact(hp)|`` for experts
    quantized online (gate + up sharing one amax, as SGLang's ``nvfp4_online`` does), by any recipe
    :func:`recipe_independent_error_bound` covers (the stored scales are not trusted):
    ``dg = |x| @ qerr_g^T`` (same for up), ``dh`` by :func:`activation_perturbation` at the hp values,
    ``|o_q - o| <= |W2q| @ dh + qerr_2 @ |h|``, then ``sum |w| do``; plus fp64 rounding (2^-40 relative)."""
    check_moe_inputs(x, topk_ids, topk_weights, experts)
    f64 = torch.float64
    xa = x.to(f64)
    y = torch.zeros(x.shape[0], x.shape[1], dtype=f64, device=x.device)
    bound = torch.zeros_like(y)
    weights = topk_weights.to(device=x.device, dtype=f64)
    act, params = experts.activation, experts.activation_params
    gated = is_gated(act)
    for batch in expert_batches(topk_ids.to(x.device), local_expert_offset(experts), experts.num_local_experts):
        e = batch.local_expert
        q = dequantize_expert(experts, e, f64)
        w13 = w13_hp[e].to(f64)
        half = w13.shape[0] // 2 if gated else w13.shape[0]
        qerr13 = recipe_independent_error_bound(w13)
        qerr2 = recipe_independent_error_bound(w2_hp[e])
        xt = xa[batch.tokens]
        ax = xt.abs()
        g = xt @ w13[:half].T
        dg = ax @ qerr13[:half].T
        u, du = (xt @ w13[half:].T, ax @ qerr13[half:].T) if gated else (None, None)
        h = apply_activation(act, g, u, params)
        dh = activation_perturbation(act, g, u, dg, du, params)
        w2 = w2_hp[e].to(f64)
        o = h @ w2.T
        w2q_abs = (q.down * q.scale_down).abs()
        do = dh @ w2q_abs.T + h.abs() @ qerr2.T
        rw = weights[batch.tokens, batch.slots].unsqueeze(-1)
        y.index_add_(0, batch.tokens, rw * o)
        bound.index_add_(0, batch.tokens, rw.abs() * (do + FP64_REL * o.abs()))
    return MoEBound(y, bound + FP64_REL * y.abs() + ABS_FLOOR)
