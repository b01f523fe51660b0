"""Derived error bounds for the W4A16 dense linear layer, and the summary figures reported next to them.

Everything is measured against the *exact* value ``y*`` (fp64, from the same dequantized weights, see
:func:`reference_impl.dense.w4a16_linear_exact`); no implementation is taken as the truth.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy
import torch

#: Unit roundoff of bfloat16 (8 significant bits incl. the implicit one): round-to-nearest error <= 2^-8 |v|.
U_BF16 = 2.0**-8
#: Unit roundoff of fp32 (24 significant bits).
U_FP32 = 2.0**-24
#: Per-operation error unit used for the K-sum. Tensor-core adders align and *truncate* (Fasi, Higham,
#: Mikaitis, Pranesh 2021, "Numerical behavior of NVIDIA tensor cores"), so one fp32 ulp per addition
#: (2^-23), not half an ulp, is what a hardware accumulator is allowed.
U_ACCUM = 2.0**-23
#: Smallest normal fp32/bf16 number (they share the exponent range).
TINY_NORMAL = 2.0**-126
#: The acceptance of FlashInfer's dense W4A16 GEMM test (tests/gemm/test_mm_bf16_fp4.py,
#: ``_assert_close_to_reference``; docs/contracts.md section 2): summary figures, looser than the bound. FlashInfer's MoE
#: tests use another criterion (docs/moe.md).
FLASHINFER_MAX_REL_L2 = 2e-2
FLASHINFER_MIN_COSINE = 0.999


def gamma(n, u: float = U_ACCUM):
    """Higham's ``gamma_n = n u / (1 - n u)`` (Lemma 3.1): bound on the relative error of ``n`` chained roundings;
    elementwise for a tensor ``n`` (the MoE's number of local contributions differs per token)."""
    if bool((n * u >= 1).any()) if isinstance(n, torch.Tensor) else n * u >= 1:
        raise ValueError(f"gamma undefined for u = {u}: n * u >= 1")
    return n * u / (1 - n * u)


def dense_error_bound(
    exact: torch.Tensor,
    magnitude: torch.Tensor,
    k: int,
    *,
    has_pre_quant_scale: bool,
    bias: torch.Tensor | None,
    weights_bf16_exact: bool = False,
    prescaled_bf16_exact: bool = False,
) -> torch.Tensor:
    """Per-element bound on ``|y - y*|`` for a conforming W4A16 dense layer, fp64, shape of ``exact``.

    Notation: ``x' = x * pre_quant_scale`` (exact), ``W = e2m1 * e4m3`` (exact in any float format with
    >= 6 significant bits: 2 of e2m1 times 4 of e4m3), ``alpha = max(weight_scale_2)`` (the docs/contracts.md section 2
    contract), ``b`` the bias,
    ``y* = alpha * (x' @ W^T) + b`` and ``A = alpha * (|x'| @ |W|^T)`` (``magnitude``). Terms:

    1. **Output rounding to bf16**: ``U_BF16 * |y*|``. The result is bf16; round-to-nearest moves a value
       by at most half an ulp, 2^-8 relative.
    2. **Accumulation**: ``gamma_{K+2} * A``. The products ``x_k * w_k`` are exact in fp32 (8 x 6 = 14
       significant bits; 22 with an AWQ-scaled fp32 ``x'``); any summation order of K terms in fp32 errs
       by at most ``gamma_{K-1} * sum|terms|`` (Higham, Accuracy and Stability, 3.1), one rounding more
       for ``* alpha`` and one for folding ``alpha`` or a bias in fp32: ``K + 2`` in all. Split-K,
       reversed order, tree reductions and atomics all fit. ``U_ACCUM`` is a full ulp because tensor cores
       truncate (see its comment).
    3. **Weight rounding**: ``U_BF16 * A``. A legitimate implementation may dequantize
       ``e2m1 * e4m3 * weight_scale_2`` in fp32 and round the weight to bf16 for a BF16 GEMM: each weight then
       carries a relative error <= 2^-8, which the sum turns into at most ``2^-8 * A``. Zero when every
       dequantized weight ``e2m1 * e4m3 * alpha`` is a BF16 number (``weights_bf16_exact``: e.g. a
       power-of-two ``alpha``, as ``e2m1 * e4m3`` has at most 5 significant bits): rounding it changes nothing.
    4. **AWQ pre-scaling** (only with ``pre_quant_scale``): ``U_BF16 * A``. Engines compute ``x * pqs`` in
       bf16 before the GEMM (SGLang: ``x = x * layer.pre_quant_scale``), one rounding of each ``x'_k``.
       Zero when every ``x * pqs`` is a BF16 number (``prescaled_bf16_exact``).
    5. **Bias addition** (only with a bias): ``U_BF16 * |y* - b|``. Engines round the GEMM output to bf16 and
       then add the bias (``out = out + bias``), so the pre-bias value is rounded once more.
    6. **Second-order slack**: the terms above are first order; products of two of them (e.g. rounding the
       output of an already perturbed sum) are below ``(U_BF16 + gamma) * (sum of terms 2-5)``; added.
    7. **Absolute floor** ``(K + 4) * 2^-126``: relative bounds do not hold in the subnormal range (and GPUs
       flush subnormals to zero): each of the ``K + 4`` operations may lose up to the smallest normal.

    Terms 2-7 bound the value ``p`` an implementation has before its final rounding to bf16:
    ``|p - y*| <= bound - U_BF16 |y*|`` (the *pre-rounding allowance* the single-rounding checks of
    :mod:`conformance.dense.single_rounding` use, with ``weights_bf16_exact`` / ``prescaled_bf16_exact`` where they
    hold). ``check_within_error_bound`` keeps terms 3 and 4 in any case: the lenient contract, which absorbs
    one extra rounding; the single-rounding checks are the strict one.

    For inputs where ``y*`` or ``A`` is non-finite the bound is NaN; non-finite outputs are judged by the
    non-finite policy instead (see :mod:`conformance.dense.checks`)."""
    exact = exact.double()
    magnitude = magnitude.double()
    g = gamma(k + 2)
    accumulated = (g + (0.0 if weights_bf16_exact else U_BF16)) * magnitude
    if has_pre_quant_scale and not prescaled_bf16_exact:
        accumulated = accumulated + U_BF16 * magnitude
    if bias is not None:
        accumulated = accumulated + U_BF16 * (exact - bias.double()).abs()
    second_order = (U_BF16 + g) * accumulated
    floor = (k + 4) * TINY_NORMAL
    return U_BF16 * exact.abs() + accumulated + second_order + floor


@dataclass(frozen=True)
class ErrorFigures:
    """Summary of one comparison: ``bound_ratio = max |y - y*| / bound`` (must be <= 1), the worst element,
    and FlashInfer-style relative L2 ``||y - y*|| / ||y*||`` and cosine similarity (over finite rows)."""

    bound_ratio: float
    worst_index: tuple[int, ...]
    worst_got: float
    worst_exact: float
    worst_bound: float
    rel_l2: float
    cosine: float

    def properties(self) -> dict[str, float]:
        """The figures recorded per test (``record_property``) for the report."""
        return {"bound_ratio": self.bound_ratio, "rel_l2": self.rel_l2, "cosine": self.cosine}


def error_figures(got: torch.Tensor, exact: torch.Tensor, bound: torch.Tensor) -> ErrorFigures:
    """Compare ``got`` with ``exact`` under ``bound`` (same shape; only finite ``exact`` elements count)."""
    g, e, b = got.double(), exact.double(), bound.double()
    finite = torch.isfinite(e) & torch.isfinite(b)
    err = torch.where(finite, (g - e).abs(), torch.zeros_like(e))
    err = torch.where(finite & ~torch.isfinite(g), torch.full_like(e, float("inf")), err)
    ratio = err / b.clamp_min(torch.finfo(torch.float64).tiny)
    ratio = torch.where(finite, ratio, torch.zeros_like(ratio))
    flat = int(torch.argmax(ratio.reshape(-1)))
    idx = tuple(int(i) for i in numpy.unravel_index(flat, tuple(e.shape))) if e.dim() else ()
    gf = torch.where(finite & torch.isfinite(g), g, torch.zeros_like(g))
    ef = torch.where(finite, e, torch.zeros_like(e))
    diff_norm = float(torch.linalg.vector_norm(gf - ef))
    ref_norm = float(torch.linalg.vector_norm(ef))
    got_norm = float(torch.linalg.vector_norm(gf))
    rel_l2 = diff_norm / ref_norm if ref_norm > 0 else (0.0 if diff_norm == 0 else float("inf"))
    if ref_norm > 0 and got_norm > 0:
        cosine = float((gf * ef).sum()) / (ref_norm * got_norm)
    else:
        cosine = 1.0 if ref_norm == got_norm else 0.0
    return ErrorFigures(
        bound_ratio=float(ratio.reshape(-1)[flat]) if ratio.numel() else 0.0,
        worst_index=idx,
        worst_got=float(g.reshape(-1)[flat]) if g.numel() else 0.0,
        worst_exact=float(e.reshape(-1)[flat]) if e.numel() else 0.0,
        worst_bound=float(b.reshape(-1)[flat]) if b.numel() else 0.0,
        rel_l2=rel_l2,
        cosine=cosine,
    )
