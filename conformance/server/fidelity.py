"""Logprob fidelity: a server whose returned logprobs were coarsened -- rounded to a decimal grid, or passed
through float16 / bfloat16 -- is flagged, even where the coarsening is below the golden bound (a logprob
rounded to 0.01 errs by at most 0.005, inside the BF16 noise a correct engine has).

Derivation (:func:`coarsened`). A correct engine's logprob is a float32 (or finer) result of a log-softmax
``x = a - b`` (the logit minus the log-sum-exp, or ``(logit - max) - log(sum)``) whose operands are below
``2^(E_MAX + 1)`` in magnitude (:data:`E_MAX` = 9: 1024; real models' logits stay far below 100). So ``x`` is
a multiple of ``g(x) = 2^(max(e, E_MAX) - 23)`` at the coarsest (``e``: the exponent of ``x``; cancellation
can make the low bits of a small ``x`` zero, which is why ``g`` is not simply ``ulp(x)``), and the bits of ``x``
below its own ulp and above ``g`` are modelled as uniformly random (the rounding-error model behind the golden
bounds). Then, per value, the probability that a correct ``x`` lies on a grid is at most

* a binary grid of spacing ``s(x)`` (float16: ``2^(e - 10)``, subnormal ``2^-24``; bfloat16: ``2^(e - 7)``):
  ``min(1, g / s)`` (one lattice point of ``g`` in ``s / g``);
* a decimal grid ``10^-d``, ``x`` within one float32 ulp ``u`` of a grid point (a server rounding in float32
  lands within half an ulp): ``min(1, (2 u + g) * 10^d)``.

Exact zeros (a token of probability 1 in float32) and non-finite values carry no information and are skipped.
A batch is flagged for a grid when *every* informative value lies on it and the product of those
probabilities (tokens independent) is at most :data:`RISK`: the false-failure probability of the check for a
correct engine is below ``RISK`` per grid and batch (six grids). A coarsening server puts every value on its
grid, so it is caught once a batch holds enough values away from 0: float16 / bfloat16 about 6 values with
``|x| >= 1``, ``0.01`` about 4, ``0.001`` 8; ``10^-4`` needs about 45 values (not reached by the scenarios'
32-token batches: below that the check says nothing).
"""
from __future__ import annotations

import math

import torch

E_MAX = 9
RISK = 1e-9
DECIMALS = (1, 2, 3, 4)
GRIDS = ("bfloat16", "float16") + tuple(f"1e-{d}" for d in DECIMALS)  # coarsest first


def _exponent(x: float) -> int:
    return math.frexp(abs(x))[1] - 1  # 2^e <= |x| < 2^(e+1)


def _granularity(x: float) -> float:
    return 2.0 ** (max(_exponent(x), E_MAX) - 23)


def _ulp32(x: float) -> float:
    return 2.0 ** (max(_exponent(x), -126) - 23)


def on_grid(x: float, grid: str) -> bool:
    if grid in ("float16", "bfloat16"):
        dtype = torch.float16 if grid == "float16" else torch.bfloat16
        return float(torch.tensor(x, dtype=torch.float64).to(dtype).double()) == x
    s = 10.0 ** -int(grid.split("-")[1])
    return abs(x - round(x / s) * s) <= _ulp32(x)


def hit_probability(x: float, grid: str) -> float:
    """Bound on the probability that a correct engine's logprob ``x`` lies on ``grid`` (module docstring)."""
    g, e = _granularity(x), _exponent(x)
    if grid == "float16":
        s = 2.0 ** (e - 10) if e >= -14 else 2.0 ** -24
    elif grid == "bfloat16":
        s = 2.0 ** (e - 7)
    else:
        return min(1.0, (2 * _ulp32(x) + g) * 10.0 ** int(grid.split("-")[1]))
    return min(1.0, g / s)


def coarsened(logprobs: list[float]) -> tuple[str, int, float] | None:
    """``(grid, values, probability)`` of the first grid every informative logprob lies on with a probability
    (for a correct engine) at most :data:`RISK`; None if there is none."""
    values = [float(x) for x in logprobs if x is not None and math.isfinite(x) and x != 0.0]
    for grid in GRIDS:
        if values and all(on_grid(x, grid) for x in values):
            log_p = sum(math.log(max(hit_probability(x, grid), 1e-300)) for x in values)
            if log_p <= math.log(RISK):
                return grid, len(values), math.exp(log_p)
    return None


def check_logprob_fidelity(logprobs: list[float], what: str) -> None:
    """Raise AssertionError (message starting with ``what``) if ``logprobs`` were coarsened to a grid."""
    found = coarsened(logprobs)
    if found:
        grid, n, p = found
        raise AssertionError(
            f"{what}: the returned logprobs are coarsened: all {n} of them lie on the {grid} grid, which a correct "
            f"engine's float32 logprobs do with probability {p:.1e} (conformance/server/fidelity.py): return "
            f"the float32 log-softmax values unrounded")
