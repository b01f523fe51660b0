"""The Triton kernel of :mod:`reference_impl.truth.store_kernel` (imported only where it runs: Triton is a CUDA
build's)."""
import triton
import triton.language as tl


@triton.jit
def _write(UP, STD, OUT, at, std_at, mask, z, HAS_UP: tl.constexpr):
    value = tl.load(STD + std_at, mask=mask, other=0.0).to(tl.float32) * z
    if HAS_UP:
        value += tl.load(UP + at, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + at, value.to(OUT.dtype.element_ty), mask=mask)


# sizes and seeds vary from call to call: not specialised on (one compiled kernel per dtype and HAS_UP)
@triton.jit(do_not_specialize=["seed", "inner", "reps"])
def store_kernel(UP, STD, OUT, seed, inner, reps, HAS_UP: tl.constexpr, BLOCK: tl.constexpr):
    """``OUT[row, i] = UP[row, i] + STD[row // reps, i] z`` over rows of ``inner`` elements, ``z`` standard
    normals: four per Philox call (two Box-Muller pairs), counter ``row inner + the first of the four``, so each
    element of a call has its own."""
    part, row = tl.program_id(0), tl.program_id(1)
    base = row.to(tl.int64) * inner
    std_base = (row // reps).to(tl.int64) * inner
    first = part.to(tl.int64) * (4 * BLOCK) + tl.arange(0, BLOCK)
    z0, z1, z2, z3 = tl.randn4x(seed, base + first)
    _write(UP, STD, OUT, base + first, std_base + first, first < inner, z0, HAS_UP)
    second = first + BLOCK
    _write(UP, STD, OUT, base + second, std_base + second, second < inner, z1, HAS_UP)
    third = second + BLOCK
    _write(UP, STD, OUT, base + third, std_base + third, third < inner, z2, HAS_UP)
    fourth = third + BLOCK
    _write(UP, STD, OUT, base + fourth, std_base + fourth, fourth < inner, z3, HAS_UP)
