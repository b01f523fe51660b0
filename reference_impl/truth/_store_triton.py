"""The Triton kernel of :mod:`reference_impl.truth.store_kernel` (imported only where it runs: Triton is a CUDA
build's)."""
import triton
import triton.language as tl


@triton.jit
def _write(UP, OUT, at, std, mask, z, HAS_UP: tl.constexpr):
    value = std * z
    if HAS_UP:
        value += tl.load(UP + at, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + at, value.to(OUT.dtype.element_ty), mask=mask)


# sizes and seeds vary from call to call: not specialised on (one compiled kernel per dtype and HAS_UP)
@triton.jit(do_not_specialize=["seed", "inner", "reps"])
def store_kernel(UP, STD, OUT, seed, inner, reps, HAS_UP: tl.constexpr, BLOCK: tl.constexpr):
    """``OUT[row, i] = UP[row, i] + STD[row // reps, i] z`` over rows of ``inner`` elements, ``z`` standard
    normals: four per Philox call (two Box-Muller pairs), counter ``row inner + the first of the four``, so each
    element of a call has its own. A program takes one sequence's ``4 BLOCK`` elements for each of its ``reps``
    replicas: their ``STD`` is read once, not once per replica."""
    part, sequence = tl.program_id(0), tl.program_id(1)
    first = part.to(tl.int64) * (4 * BLOCK) + tl.arange(0, BLOCK)
    second, third, fourth = first + BLOCK, first + 2 * BLOCK, first + 3 * BLOCK
    std_base = sequence.to(tl.int64) * inner
    std0 = tl.load(STD + std_base + first, mask=first < inner, other=0.0).to(tl.float32)
    std1 = tl.load(STD + std_base + second, mask=second < inner, other=0.0).to(tl.float32)
    std2 = tl.load(STD + std_base + third, mask=third < inner, other=0.0).to(tl.float32)
    std3 = tl.load(STD + std_base + fourth, mask=fourth < inner, other=0.0).to(tl.float32)
    for r in range(reps):
        base = (sequence.to(tl.int64) * reps + r) * inner
        z0, z1, z2, z3 = tl.randn4x(seed, base + first)
        _write(UP, OUT, base + first, std0, first < inner, z0, HAS_UP)
        _write(UP, OUT, base + second, std1, second < inner, z1, HAS_UP)
        _write(UP, OUT, base + third, std2, third < inner, z2, HAS_UP)
        _write(UP, OUT, base + fourth, std3, fourth < inner, z3, HAS_UP)
