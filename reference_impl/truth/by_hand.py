"""The probed passes' attention block and rotary embedding by hand (:mod:`reference_impl.truth.instrument`
dispatches to them on a probe's replicated rows): each sequence's primal once, each replica's tangent by
forward-mode's rules, and the stores of the forward_ad path with the same draws in the same order
(:meth:`reference_impl.truth.probe_draws.Probe.store_tangent`). forward_ad would compute every primal operation
once per replica."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def primal(t):
    """``t`` (a tensor, or a tuple or list of them) without forward-mode tangents, detached: a store's magnitudes
    need none (under probes that halves their cost)."""
    if isinstance(t, torch.Tensor):
        return torch.autograd.forward_ad.unpack_dual(t).primal.detach()
    if isinstance(t, (tuple, list)):
        return type(t)(primal(x) for x in t)
    return t


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """transformers' ``q cos + rotate_half(q) sin`` (``interleave``: DeepSeek's pairs de-interleaved first)."""
    if interleave:
        x = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
    h = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., h:], x[..., :h]), dim=-1) * sin


def _deinterleave(x: torch.Tensor, interleave: bool) -> torch.Tensor:
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1) if interleave else x


def _add_rotated(out: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """``out += x cos + rotate_half(x) sin`` (``x`` de-interleaved; broadcast to ``out``), by halves:
    ``rotate_half(x) = (-x_hi, x_lo)``."""
    h = x.shape[-1] // 2
    lo, hi = out[..., :h], out[..., h:]
    lo.addcmul_(x[..., :h], cos[..., :h]).addcmul_(x[..., h:], sin[..., :h], value=-1)
    hi.addcmul_(x[..., h:], cos[..., h:]).addcmul_(x[..., :h], sin[..., h:])


def probed_rotary(probe, q, k, cos, sin, interleave: bool):
    """The rotary embedding under probes, by hand: the primal once per sequence (what transformers computes), each
    replica's tangent ``rot(dx; cos, sin) + rot(x; dcos, dsin)`` (the rotation is linear in each), and the stores
    of the wrapper's forward_ad path with the same draws in the same order (the tables', then q's and k's)."""
    reps = probe.replicas
    (q1, qt), (k1, kt) = probe.split(q), probe.split(k)  # [S, H, T, d], [S K, H, T, d]
    n = q1.shape[0]
    with torch.no_grad():
        tables = []
        for table in (primal(cos), primal(sin)):
            one = table.expand(n, *table.shape[1:])
            tables.append((one.unsqueeze(1), probe.store_tangent("round", one, None, None, 0)))
        (c1, dc), (s1, ds) = tables
        dc, ds = (t.view(n, reps, 1, *t.shape[1:]) for t in (dc, ds))  # [S, K, 1, T, d]
        out = []
        for x1, xt in ((q1, qt), (k1, kt)):
            value = rotate(x1, c1, s1, interleave)
            tangent = x1.new_zeros(n, reps, *x1.shape[1:])
            if xt is not None:
                _add_rotated(tangent, _deinterleave(xt, interleave).view(tangent.shape), c1[:, None], s1[:, None])
            _add_rotated(tangent, _deinterleave(x1, interleave)[:, None], dc, ds)
            mag = rotate(x1, c1, 0 * s1, interleave).abs() + rotate(x1, 0 * c1, s1, interleave).abs()
            tangent = probe.store_tangent("sum", value, tangent.view(n * reps, *x1.shape[1:]), mag, 0)
            out.append(probe.join(value, tangent))
    return tuple(out)


def probed_attention_block(probe, query, key, value, causal, scaling, keys: int):
    """``instrument._attention_block`` under probes, by hand: its primal once per sequence, each replica's tangent
    the forward-mode one with the stores' draws (:meth:`reference_impl.truth.probe_draws.Probe.store_tangent`, the
    same draws in the same order). forward_ad would compute the ``T^2`` primal once per replica; and the tangent's
    ``T^2`` work is what a long prefill costs, so it is written for few passes over it: the scaling on the
    ``T x d`` operands, no masking of the tangent (a masked probability is 0, so is its tangent), ``q kt^T``
    accumulated in place, and the softmax's ``p (t - sum p t)`` as ``(p t) @ v - (sum p t) out``. On CUDA the kernels of
    :mod:`reference_impl.truth.attention_kernel` do it without ``T^2`` tensors (:func:`probed_attention_kernel`)."""
    k = probe.replicas
    (q1, k1, v1), (qt, kt, vt) = _attention_operands(probe, query, key, value)

    def each(t):  # [S * K, ...] -> [S, K, ...]
        return t.reshape(q1.shape[0], k, *t.shape[1:])
    with torch.no_grad():
        k1t = k1.transpose(2, 3)
        scores = torch.matmul(q1, k1t) * scaling
        # the scores' tangent from keys and key tangents centred over the keys: a row's constant leaves the
        # softmax's tangent exactly as it is, and a mean the keys share (real models' keys have one) would
        # otherwise enter each product, and its rounding (TF32 on CUDA), at full size
        kc, ktc = k1 - k1.mean(-2, keepdim=True), kt - kt.mean(-2, keepdim=True)
        st = torch.matmul(each(qt) * scaling, kc.transpose(2, 3)[:, None])  # [S, K, H, Tq, Tk]
        # + q1 kt^T accumulated in place (no second T^2 temporary); the T x d operands laid out per (S, K, H)
        s_, h_, tq, d_ = q1.shape
        q_each = (q1 * scaling)[:, None].expand(s_, k, h_, tq, d_).reshape(-1, tq, d_)
        st.view(-1, *st.shape[-2:]).baddbmm_(q_each, each(ktc).transpose(-1, -2).reshape(-1, d_, kt.shape[-2]))
        dot_info = torch.matmul(q1.abs(), k1t.abs()) * scaling
        p = F.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1, dtype=torch.float32).to(query.dtype)
        fused = probe.softmax_stores(scores, st, dot_info, query.shape[-1], p)  # CUDA: one pass over st
        if fused is not None:
            st, mean = fused[0].flatten(0, 1), fused[1]
        else:
            st = each(probe.store_tangent("dot", scores, st, dot_info, query.shape[-1]))
            st *= p[:, None]  # p t: the probabilities' tangent before their rounding, less p (sum p t)
            mean = st.sum(-1, keepdim=True)  # sum p t
            st = probe.store_tangent("round", p, st, None, 0)  # the probabilities' rounding, |p| = p
        out = torch.matmul(p, v1)
        ot = torch.matmul(each(st), v1[:, None]) + torch.matmul(p[:, None], each(vt))
        ot -= mean * out[:, None]
        ot = probe.store_tangent("dot", out, ot.reshape(-1, *ot.shape[2:]), torch.matmul(p, v1.abs()), keys)
    return probe.join(out, ot)


def _attention_operands(probe, *duals):
    """Each sequence's primal ``[S, H, T, d]`` of the attention's replicated duals, and their replicas' tangents
    ``[S K, H, T, d]`` (zeros where one has none)."""
    ones, tangents = zip(*(probe.split(x) for x in duals))
    return ones, tuple(torch.zeros(x.shape, dtype=x.dtype, device=x.device) if t is None else t
                       for x, t in zip(duals, tangents))


def probed_attention_kernel(probe, query, key, value, scaling, keys: int):
    """:func:`probed_attention_block` over every query at once by the Triton kernels
    (:mod:`reference_impl.truth.attention_kernel`: no ``T^2`` tensor in memory; their own draws for the scores'
    and probabilities' stores), then the output's store."""
    from reference_impl.truth import attention_kernel
    from reference_impl.truth.stores import U_ACCUM, U_BF16

    (q1, k1, v1), (qt, kt, vt) = _attention_operands(probe, query, key, value)
    # one Philox stream per sequence, head and replica: a block of the probe's keys (no device read per call)
    seed = probe.keys(q1.device, q1.shape[0] * q1.shape[1] * probe.replicas)
    with torch.no_grad():
        out, pav, ot = attention_kernel.probed_attention(q1, k1, v1, qt, kt, vt, scaling, U_BF16,
                                                         U_ACCUM * (query.shape[-1] + 2), seed)
        ot = probe.store_tangent("dot", out, ot, pav, keys)
    return probe.join(out, ot)
