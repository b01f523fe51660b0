"""The order-independent GEMM behind the reference on CPU (:mod:`reference_impl.dense.exact_dot`): its sums are exact
(checked with rational arithmetic), so the result does not change with the K order, the row or column
chunking or the thread count, and the reference's dense and MoE outputs and the FlashInfer emulator's are
bitwise reproducible by construction."""
from __future__ import annotations

from fractions import Fraction

import pytest
import torch

from reference_impl.moe import grouped as moe_grouped
from reference_impl.dense import w4a16_linear
from reference_impl.dense.exact_dot import WEIGHT_MAX_UNITS, exact_matmul, exact_matmul_fp32, slice_bits
from reference_impl.format.nvfp4 import codes_times_block_scales


def _weights(n: int, k: int, g: torch.Generator) -> torch.Tensor:
    packed = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
    scales = torch.randint(0, 0x7F, (n, k // 16), generator=g, dtype=torch.uint8)  # every finite E4M3 byte
    return codes_times_block_scales(packed, scales.view(torch.float8_e4m3fn))


def _wide_activations(m: int, k: int, g: torch.Generator, dtype=torch.bfloat16) -> torch.Tensor:
    """Values spanning 2^-60 .. 2^60 within each row: several slices per row."""
    return (torch.randn(m, k, generator=g) * torch.exp2(torch.randint(-60, 60, (m, k), generator=g).float())).to(dtype)


def _exact(a: torch.Tensor, w: torch.Tensor) -> list[list[Fraction]]:
    rows = [[Fraction(v) for v in r] for r in a.double().tolist()]
    cols = [[Fraction(v) for v in r] for r in w.double().tolist()]
    return [[sum(x * y for x, y in zip(r, c)) for c in cols] for r in rows]


def test_slice_bits_keep_every_partial_sum_an_fp64_integer() -> None:
    for k in (1, 16, 128, 4096, 14336, 1 << 20):
        b = slice_bits(k)
        assert k * 2**b * WEIGHT_MAX_UNITS <= 2**53 < k * 2 ** (b + 1) * WEIGHT_MAX_UNITS
    assert (slice_bits(128), slice_bits(14336)) == (24, 17)


@pytest.mark.parametrize("k,dtype", [(128, torch.bfloat16), (4096, torch.bfloat16), (512, torch.float32)])
def test_result_is_the_exact_sum_rounded_and_order_free(k: int, dtype: torch.dtype) -> None:
    """Rows spanning 120 binades (several slices): within the slices' fp64 additions (<= 2^-52 relative per
    slice) of the rational sum, and bitwise the same for a permuted K, row by row and column by column."""
    g = torch.Generator().manual_seed(k)
    a, w = _wide_activations(4, k, g, dtype), _weights(3, k, g)
    got = exact_matmul(a, w)
    for i, row in enumerate(_exact(a, w)):
        for j, want in enumerate(row):
            assert abs(Fraction(float(got[i, j])) - want) <= abs(want) * Fraction(8, 2**53), (i, j)
    perm = torch.randperm(k, generator=g)
    assert torch.equal(exact_matmul(a[:, perm], w[:, perm]), got)
    assert torch.equal(torch.cat([exact_matmul(a[i:i + 1], w) for i in range(4)]), got)
    assert torch.equal(torch.cat([exact_matmul(a, w[j:j + 1]) for j in range(3)], dim=1), got)
    assert torch.equal(exact_matmul_fp32(a, w), got.float())


def test_single_slice_rows_are_correctly_rounded() -> None:
    """Gaussian bf16 rows at K = 128 fit one slice: the fp32 result is the exact sum rounded once."""
    g = torch.Generator().manual_seed(3)
    a, w = torch.randn(6, 128, generator=g).bfloat16(), _weights(5, 128, g)
    got = exact_matmul_fp32(a, w)
    for i, row in enumerate(_exact(a, w)):
        for j, want in enumerate(row):
            assert float(got[i, j]) == float(torch.tensor(float(want), dtype=torch.float64).float())


def test_non_finite_values_propagate_as_in_fp64() -> None:
    g = torch.Generator().manual_seed(4)
    a, w = torch.randn(4, 64, generator=g).bfloat16(), _weights(3, 64, g)
    a[0, 5], a[1, 7], a[2, 1], a[2, 2] = float("inf"), float("nan"), float("inf"), float("-inf")
    want = a.double() @ w.double().T
    got = exact_matmul(a, w)
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    finite = torch.isfinite(want)
    assert torch.equal(torch.isinf(got), torch.isinf(want)) and torch.equal(got[torch.isinf(got)], want[torch.isinf(want)])
    assert bool(((got - want)[finite].abs() <= 1e-9 * want[finite].abs()).all())


def test_reference_outputs_do_not_depend_on_the_thread_count() -> None:
    """The shape where a CPU BLAS splits K by thread count (M 7, N 192, K 14336), through the dense reference,
    and a MoE case through the grouped reference: the same bits with 1 and 2 threads."""
    g = torch.Generator().manual_seed(5)
    packed = torch.randint(0, 256, (192, 7168), generator=g, dtype=torch.uint8)
    scales = torch.randint(0x30, 0x70, (192, 896), generator=g, dtype=torch.uint8).view(torch.float8_e4m3fn)
    x = torch.randn(7, 14336, generator=g).bfloat16()
    from conformance.moe.cases import MOE_CASES, build_global_experts, build_inputs

    case = next(c for c in MOE_CASES if c.id == "t128_e8_k2_geglu")
    experts, (mx, ids, tw) = build_global_experts(case, "cpu"), build_inputs(case, "cpu")
    prepared = moe_grouped.prepare_experts(experts)
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            results.append((w4a16_linear(x, packed, scales, torch.tensor(0.01)),
                            moe_grouped.run_prepared_experts(prepared, mx, ids, tw)))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def test_bad_shapes_raise() -> None:
    with pytest.raises(ValueError, match="exact_matmul needs"):
        exact_matmul(torch.zeros(2, 3), torch.zeros(4, 5))
