"""Order-independent GEMMs against decoded NVFP4 weights: every sum is exact, so no BLAS blocking, K-split,
thread count or run-time load can change a bit of the result.

Why: a BLAS chooses its summation order at run time (oneMKL: by thread count, ``MKL_DYNAMIC``, alignment and
code branch; its documentation promises run-to-run equality only with a fixed thread count, ``MKL_DYNAMIC``
and ``OMP_DYNAMIC`` off and CNR mode on). An fp32 sum in such an order is deterministic only as long as the
BLAS repeats its choice, and one changed order flips the bf16 rounding of some outputs (and, through the
MoE's bf16 intermediate, of whole rows). The reference must not depend on that.

How (:func:`exact_matmul`): every decoded weight ``w = e2m1 * e4m3`` is an integer multiple of ``q = 2^-10``
with ``|w| <= 2688`` (:func:`reference_impl.format.nvfp4.codes_times_block_scales`), i.e. ``w = W q`` with ``|W| <=
W_MAX = 2688 * 1024 < 2^22``. Each row of the activations is cut into slices on a grid fixed by that row
alone: with ``2^E`` the smallest power of two above the row's largest magnitude and ``g = 2^(E - b)``, slice
1 is the row truncated to a multiple of ``g`` (an integer ``S`` times ``g`` with ``|S| < 2^b``); the
remainder (every ``|r| < g``) is sliced the same way, until nothing is left. For one slice, every product is
``S W g q`` and every partial sum of ``K`` products is an integer multiple of ``g q`` below ``K 2^b W_MAX``
in magnitude; with ``b`` the largest integer such that ``K 2^b W_MAX <= 2^53`` (:func:`slice_bits`: 24 bits
at ``K = 128``, 17 at ``K = 14336``) every partial sum is an fp64 integer multiple of ``g q``, i.e. exact:
the fp64 GEMM of a slice returns the exact sum whatever order, blocking or FMA use it picks (a BLAS
computes each output as a sum of its ``K`` products; none here uses Strassen-like schemes). The slices'
exact sums are added in slice order in fp64 (a fixed order: a rounding of at most ``2^-53`` relative per
slice, and most rows have one or two slices), and the fp32 callers round that once more to fp32: the fp32
accumulator is within one fp32 rounding (plus ``2^-52`` relative) of the exact sum, far inside the fp32
accumulation bound (``gamma_K``) the checks allow for any order.

Non-finite activations (inf/NaN) are kept out of the slicing and contribute through one more fp64 GEMM of
those entries alone: inf and NaN propagate the same way in any order (fp64 cannot overflow here: ``|x| <
2^128``, ``|w| < 2^12``, ``K < 2^31``). NaN weights (NaN block scales) give NaN in every order too.

Cost: one fp64 GEMM per slice, the later ones only over rows with a remainder (a row of ``K`` gaussian
values needs a second slice when some value is below ``2^(8 - b)`` of its maximum: rare at small K, most rows
at ``K >= 4096``), plus a pass over the activations per slice.
"""
from __future__ import annotations

import torch

#: Decoded NVFP4 weights are integer multiples of ``WEIGHT_QUANTUM`` (``0.5 * 2^-9``: the smallest E2M1
#: magnitude times the smallest E4M3 subnormal) of magnitude at most ``WEIGHT_MAX_UNITS`` of it (``6 * 448``).
WEIGHT_QUANTUM = 2.0**-10
WEIGHT_MAX_UNITS = 6 * 448 * 1024
_FP64_INTEGERS = 2**53


def slice_bits(k: int) -> int:
    """The largest ``b`` with ``k * 2^b * WEIGHT_MAX_UNITS <= 2^53``: slices of ``b`` bits sum exactly in fp64."""
    if k < 1:
        return 53
    bits = (_FP64_INTEGERS // (k * WEIGHT_MAX_UNITS)).bit_length() - 1
    if bits < 1:
        raise ValueError(f"K = {k} is too large for exact fp64 sums of decoded NVFP4 weights")
    return bits


def exact_matmul(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``a [M, K] @ w[N, K]^T`` as fp64 ``[M, N]``: per slice of ``a`` the exact sum, the slices added in a fixed
    order (module docstring), independent of the BLAS's order, blocking and threads.

    ``a``: any float dtype of at most 53 significant bits (bf16, fp32, fp64 values of bf16/fp32 products).
    ``w``: decoded NVFP4 weights (``codes_times_block_scales``, any float dtype; upcast to fp64 here unless
    already fp64). The result depends on ``a``'s rows one at a time and on ``w``'s rows one at a time, so
    chunking either side (or grouping rows by expert) changes nothing."""
    if a.dim() != 2 or w.dim() != 2 or a.shape[1] != w.shape[1]:
        raise ValueError(f"exact_matmul needs a [M, K] and w [N, K], got {tuple(a.shape)} and {tuple(w.shape)}")
    m, k = a.shape
    w64 = w if w.dtype == torch.float64 else w.to(torch.float64)
    out = torch.zeros(m, w.shape[0], dtype=torch.float64, device=a.device)
    if m == 0 or k == 0 or w.shape[0] == 0:
        return out
    rest = a.to(torch.float64)
    finite = torch.isfinite(rest)
    if not bool(finite.all()):
        out += torch.where(finite, 0.0, rest) @ w64.T  # inf/NaN entries alone: same result in any order
        rest = torch.where(finite, rest, 0.0)
    bits = slice_bits(k)
    rows = torch.arange(m, device=a.device)
    while True:
        live = rest.ne(0).any(dim=1)
        if not bool(live.any()):
            return out
        if not bool(live.all()):
            rows, rest = rows[live], rest[live]
        _, exponent = torch.frexp(rest.abs().amax(dim=1))  # max |r| < 2^exponent
        grid = _power_of_two(exponent.to(torch.int64) - bits).unsqueeze(1)
        piece = torch.trunc(rest / grid) * grid  # exact: power-of-two scalings and an integer part
        if rows.numel() == m:
            out += piece @ w64.T
        else:  # each row once: no accumulation order to choose
            out.index_copy_(0, rows, out.index_select(0, rows) + piece @ w64.T)
        rest = rest - piece  # exact: the bits of rest below the grid


def _power_of_two(exponent: torch.Tensor) -> torch.Tensor:
    """``2^exponent`` as fp64, built from its bits (exact; exponents here lie in [-300, 128])."""
    return ((exponent + 1023) << 52).view(torch.float64)


def exact_matmul_fp32(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """:func:`exact_matmul` rounded to fp32: the fp32 accumulator of ``a @ w^T``, order-independent."""
    return exact_matmul(a, w).to(torch.float32)
