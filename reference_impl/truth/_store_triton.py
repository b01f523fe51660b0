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


@triton.jit
def _softmax_half(ST, at, mask, p, std, z_dot, z_round, u_round):
    """One half of a ``[replicas, BLOCK]`` tile: ``t = ST + std z_dot`` (the scores' store), ``p t`` and its row
    sums, ``p t + u_round p z_round`` (the probabilities' store) written back."""
    t = tl.load(ST + at, mask=mask, other=0.0) + std[None, :] * z_dot
    pt = p[None, :] * t
    tl.store(ST + at, pt + u_round * p[None, :] * z_round, mask=mask)
    return tl.sum(pt, axis=1)


@triton.jit(do_not_specialize=["seed", "tk", "rows_per_seq", "reps", "u_round"])
def softmax_stores_kernel(ST, P, STD, MEAN, seed, tk, rows_per_seq, reps, u_round, KP: tl.constexpr,
                          BLOCK: tl.constexpr):
    """One query row (sequence ``s``, head and query ``hq``) of a probed softmax, every replica at once: with
    ``ST [S, reps, rows_per_seq, tk]`` the scores' tangents and ``P``, ``STD`` ``[S, rows_per_seq, tk]`` the
    probabilities and the scores' store's standard deviation, ``ST <- p (ST + STD z1) + u_round p z2`` in place and
    ``MEAN[s, r, hq] = sum_j p (ST + STD z1)``. Normals from Philox (``randn4x``: the two of an element of a
    tile's first half and the two of the element ``BLOCK`` columns on, the counter the first one's position)."""
    row = tl.program_id(0)
    s = row // rows_per_seq
    hq = row % rows_per_seq
    r = tl.arange(0, KP)
    live = r < reps
    rep_row = ((s.to(tl.int64) * reps + r) * rows_per_seq + hq) * tk  # [KP]
    one_row = row.to(tl.int64) * tk
    acc = tl.zeros([KP], dtype=tl.float32)
    for c0 in range(0, tk, 2 * BLOCK):
        first = c0 + tl.arange(0, BLOCK)
        second = first + BLOCK
        m1, m2 = first < tk, second < tk
        at1 = rep_row[:, None] + first[None, :]
        z0, z1, z2, z3 = tl.randn4x(seed, at1)
        p1 = tl.load(P + one_row + first, mask=m1, other=0.0)
        sd1 = tl.load(STD + one_row + first, mask=m1, other=0.0)
        acc += _softmax_half(ST, at1, live[:, None] & m1[None, :], p1, sd1, z0, z1, u_round)
        p2 = tl.load(P + one_row + second, mask=m2, other=0.0)
        sd2 = tl.load(STD + one_row + second, mask=m2, other=0.0)
        acc += _softmax_half(ST, at1 + BLOCK, live[:, None] & m2[None, :], p2, sd2, z2, z3, u_round)
    tl.store(MEAN + (s.to(tl.int64) * reps + r) * rows_per_seq + hq, acc, mask=live)
