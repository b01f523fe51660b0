"""Single-rounding statistics for BF16 outputs: do they come from ONE round-to-nearest of an fp32 (or better)
accumulation, or did the datapath round once more (split-K partial sums stored in BF16, a truncating final
FP32 -> BF16 conversion)? The per-element error bound (:mod:`reference_impl.bounds.dense`) cannot see that: it allows
each output half a BF16 ulp plus the accumulation allowance, and one extra rounding stays inside it.

Everything is measured against the exact value ``y*`` (fp64) and the contract's *pre-rounding allowance*
``d`` = the error bound minus its final-rounding term: a conforming implementation computes some ``p`` with
``|p - y*| <= d`` and returns ``RN_bf16(p)`` (see :func:`reference_impl.bounds.dense.dense_error_bound`, terms 2-7).

1. **Correct rounding on decidable elements** (deterministic, no false failures). Round-to-nearest is
   monotone, so if ``RN(y* - d) == RN(y* + d)`` every admissible ``p`` rounds to that value: the output must
   equal ``RN(y*)`` exactly. An extra rounding (BF16 partials) moves ``p`` by up to half a BF16 ulp of the
   partials and flips a sizeable share of decidable elements; truncation flips about half.
2. **Rounding direction** (statistical). Among elements with ``d <= ulp/8`` (``ulp`` = BF16 spacing at
   ``y*``) and ``y != y*``, count those rounded toward zero (``|y| < |y*|``). Model: the position of ``y*``
   inside its BF16 interval is uniform and independent across elements (the low bits of a K-term sum of
   products). Then a round-to-nearest output is toward zero with probability ``<= 1/2 + d/ulp <= 5/8`` (the
   accumulation error, at most ``d``, may push every element toward zero), a truncating one with
   probability ``>= 1 - 1/8``. Hoeffding: the observed fraction of a correct implementation exceeds
   ``5/8 + t`` with probability ``<= exp(-2 n t^2)``; ``t`` is chosen per run so that this is
   :data:`FALSE_FAILURE_PROBABILITY`.
3. **Error spread in ulps** (statistical, the calibrated summary threshold). ``r = (y - y*) / ulp`` over the
   same elements (``y == y*`` included), ``delta = d / ulp <= 1/8``. Where ``RN(p) == RN(y*)``,
   ``r = (RN(y*) - y*) / ulp``, whose square has mean 1/12 for a uniform position ``theta`` of ``y*``; they can
   differ only when ``theta`` is within ``delta`` of the midpoint (probability ``2 delta``), and there ``r^2``
   exceeds ``((RN(y*) - y*) / ulp)^2 >= (1/2 - delta)^2`` by at most ``(1/2 + delta)^2 - (1/2 - delta)^2 =
   2 delta``. So ``E[r^2] <= 1/12 + 4 delta^2`` whatever the accumulation error does, and ``r^2 <=
   (1/2 + delta)^2 <= 25/64``. Hoeffding: ``mean(r^2) > mean(1/12 + 4 delta^2) + t`` with probability
   ``<= exp(-2 n t^2 / (25/64)^2)``, ``t`` chosen for :data:`FALSE_FAILURE_PROBABILITY`.
   Measured (tests/dense/test_dense_mutants.py, six correct variants on every single-rounding cpu case): mean r^2
   0.082-0.086 (1/12 = 0.083), at most 0.84 of the limit; truncation ~0.33 and BF16 split-K partials
   0.16-0.56, 1.6-5.7x the limit.

These checks hold an implementation to exactly one rounding after accumulating exact products: stricter than
the error-bound contract (which is what an implementation must meet); a backend that rounds twice on purpose
can accept them in its expectation file (docs/dense.md).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

#: Per evaluation of a statistical check, the probability that a correct implementation fails it.
FALSE_FAILURE_PROBABILITY = 1e-9
#: Elements whose allowance ``d`` exceeds this fraction of their BF16 ulp are left out of the statistics.
MAX_ALLOWANCE_ULPS = 1.0 / 8.0
#: Fewest eligible elements a statistical check needs (at 500, the direction threshold is 5/8 + 0.144).
MIN_STATISTIC_ELEMENTS = 500
#: Fewest decidable elements for the correct-rounding check to say anything about a case.
MIN_DECIDABLE_ELEMENTS = 64
_BF16_MANTISSA_BITS = 8  # significant bits, the implicit one included
_BF16_MIN_EXP = -125  # frexp exponent of the smallest normal 2^-126 (= 0.5 * 2^-125)
_BF16_MAX = float(torch.finfo(torch.bfloat16).max)


def bf16_ulp(v: torch.Tensor) -> torch.Tensor:
    """Spacing of the BF16 numbers around fp64 ``v`` (the binade of ``|v|``; subnormal spacing 2^-133 below 2^-126)."""
    _, e = torch.frexp(v.double().abs())
    return torch.ldexp(torch.ones_like(v, dtype=torch.float64), e.clamp_min(_BF16_MIN_EXP) - _BF16_MANTISSA_BITS)


def round_to_bf16_exact(v: torch.Tensor) -> torch.Tensor:
    """fp64 ``v`` rounded once to the nearest BF16 value (ties to even), as fp64. Not ``v.bfloat16()``: PyTorch
    converts fp64 through fp32, which rounds twice. Values beyond BF16's range become +-inf."""
    v = v.double()
    ulp = bf16_ulp(v)
    rounded = torch.round(v / ulp) * ulp  # v / ulp is exact (a power of two); torch.round ties to even
    limit = _BF16_MAX + bf16_ulp(torch.tensor(_BF16_MAX, dtype=torch.float64)) / 2
    return torch.where(rounded.abs() >= limit, torch.copysign(torch.full_like(v, math.inf), v), rounded)


def is_bf16_exact(v: torch.Tensor) -> bool:
    """Every finite element of ``v`` is a BF16 number (so rounding it to BF16 is exact)."""
    v = v.double()
    finite = torch.isfinite(v)
    return bool((round_to_bf16_exact(v[finite]) == v[finite]).all())


def decidable(exact: torch.Tensor, allowance: torch.Tensor) -> torch.Tensor:
    """Elements whose every admissible pre-rounding value ``p`` (``|p - y*| <= allowance``) rounds to the same BF16
    number. ``allowance`` is widened by 2^-40 relative for the fp64 evaluation of ``y* +- d`` itself."""
    d = allowance.double() * (1 + 2.0**-40)
    lo, hi = round_to_bf16_exact(exact - d), round_to_bf16_exact(exact + d)
    return torch.isfinite(exact) & torch.isfinite(d) & (lo == hi)


def statistic_elements(exact: torch.Tensor, allowance: torch.Tensor) -> torch.Tensor:
    """Elements the two statistics use: finite, normal BF16 range, allowance <= ulp / 8."""
    e = exact.double()
    fine = torch.isfinite(e) & torch.isfinite(allowance) & (e.abs() >= 2.0**-126) & (e.abs() < _BF16_MAX)
    return fine & (allowance.double() <= MAX_ALLOWANCE_ULPS * bf16_ulp(e))


def hoeffding_margin(n: int, value_range: float, probability: float = FALSE_FAILURE_PROBABILITY) -> float:
    """``t`` with ``exp(-2 n t^2 / range^2) = probability``: how far a mean of ``n`` independent variables in an
    interval of width ``range`` may exceed its expectation before the excess is that unlikely."""
    return value_range * math.sqrt(math.log(1.0 / probability) / (2.0 * n))


@dataclass(frozen=True)
class RoundingFigures:
    """What the single-rounding checks measured on one output."""

    decidable: int
    mismatches: int  # decidable elements not equal to RN(y*)
    first_mismatch: tuple[int, ...] | None
    eligible: int  # elements in the statistics
    informative: int  # eligible and y != y* (the direction statistic's n)
    toward_zero_fraction: float
    direction_limit: float
    mean_sq_ulps: float
    mean_sq_ulps_expected: float
    mean_sq_ulps_limit: float

    def properties(self) -> dict[str, float]:
        return {"decidable": self.decidable, "rn_mismatches": self.mismatches,
                "toward_zero_fraction": self.toward_zero_fraction, "direction_limit": self.direction_limit,
                "mean_sq_ulps": self.mean_sq_ulps, "mean_sq_ulps_limit": self.mean_sq_ulps_limit}


def rounding_figures(got: torch.Tensor, exact: torch.Tensor, allowance: torch.Tensor) -> RoundingFigures:
    """The three single-rounding statistics of ``got`` (bf16) against ``exact`` (fp64) and the pre-rounding
    ``allowance`` (fp64), all the same shape."""
    y, e, d = got.double(), exact.double(), allowance.double()
    dec = decidable(e, d)
    wrong = dec & (y != round_to_bf16_exact(e))
    first = tuple(int(i) for i in wrong.nonzero()[0]) if bool(wrong.any()) else None
    stat = statistic_elements(e, d) & torch.isfinite(y)
    ulp = bf16_ulp(e)
    informative = stat & (y != e)
    n_inf = int(informative.sum())
    toward = int((informative & (y.abs() < e.abs())).sum())
    fraction = toward / n_inf if n_inf else float("nan")
    direction_limit = 0.5 + MAX_ALLOWANCE_ULPS + (hoeffding_margin(n_inf, 1.0) if n_inf else math.inf)
    n_stat = int(stat.sum())
    r2 = ((y - e) / ulp)[stat].square()
    delta = (d / ulp)[stat]
    expected = float((1.0 / 12.0 + 4 * delta.square()).mean()) if n_stat else float("nan")
    spread_range = (0.5 + MAX_ALLOWANCE_ULPS) ** 2
    return RoundingFigures(
        decidable=int(dec.sum()),
        mismatches=int(wrong.sum()),
        first_mismatch=first,
        eligible=n_stat,
        informative=n_inf,
        toward_zero_fraction=fraction,
        direction_limit=direction_limit,
        mean_sq_ulps=float(r2.mean()) if n_stat else float("nan"),
        mean_sq_ulps_expected=expected,
        mean_sq_ulps_limit=expected + (hoeffding_margin(n_stat, spread_range) if n_stat else math.inf),
    )
