"""The Triton kernels of :mod:`reference_impl.truth.attention_kernel` (imported only where they run: Triton is a
CUDA build's). ``SCORES``: the scores' product precision (``tf32x3``, ``ieee`` or ``tf32``), the same in both
kernels, so that the tangent kernel's probabilities are the primal kernel's."""
import triton
import triton.language as tl


# lengths and seeds vary from call to call: not specialised on (one compiled kernel for every length)
@triton.jit(do_not_specialize=["t_q", "t_k", "off"])
def primal_kernel(Q, K, V, M, L, O, OA, scale, t_q, t_k, off, heads,
                  sq0, sq1, sq2, sk0, sk1, sk2, sv0, sv1, sv2,
                  BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, SCORES: tl.constexpr):
    pid_m, b = tl.program_id(0), tl.program_id(1)
    s_, h = b // heads, b % heads
    rows = pid_m * BM + tl.arange(0, BM)
    dims = tl.arange(0, D)
    q = tl.load(Q + s_ * sq0 + h * sq1 + rows[:, None] * sq2 + dims[None, :], mask=rows[:, None] < t_q, other=0.0)
    m = tl.full((BM,), float("-inf"), tl.float32)
    lsum = tl.zeros((BM,), tl.float32)
    acc = tl.zeros((BM, D), tl.float32)
    acc_abs = tl.zeros((BM, D), tl.float32)
    hi = tl.minimum(t_k, off + (pid_m + 1) * BM)  # the keys up to the block's last query
    for start in range(0, hi, BN):
        cols = start + tl.arange(0, BN)
        kmask = cols[:, None] < t_k
        k = tl.load(K + s_ * sk0 + h * sk1 + cols[:, None] * sk2 + dims[None, :], mask=kmask, other=0.0)
        v = tl.load(V + s_ * sv0 + h * sv1 + cols[:, None] * sv2 + dims[None, :], mask=kmask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=SCORES) * scale
        valid = (cols[None, :] <= rows[:, None] + off) & (cols[None, :] < t_k)
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        lsum = lsum * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p, v)
        acc_abs = acc_abs * alpha[:, None] + tl.dot(p, tl.abs(v))
        m = m_new
    rmask = rows < t_q
    tl.store(M + b * t_q + rows, m, mask=rmask)
    tl.store(L + b * t_q + rows, lsum, mask=rmask)
    o_at = b * t_q * D + rows[:, None] * D + dims[None, :]
    tl.store(O + o_at, acc / lsum[:, None], mask=rmask[:, None])
    tl.store(OA + o_at, acc_abs / lsum[:, None], mask=rmask[:, None])

@triton.jit(do_not_specialize=["seed", "t_q", "t_k", "off"])
def tangent_kernel(Q, K, V, QT, KT, VT, KBAR, KTBAR, M, L, O, OT, seed, scale, u_bf16, c_acc, t_q, t_k, off,
                   heads, reps,
                   sq0, sq1, sq2, sk0, sk1, sk2, sv0, sv1, sv2,
                   sqt0, sqt1, sqt2, skt0, skt1, skt2, svt0, svt1, svt2,
                   BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, SCORES: tl.constexpr):
    pid_m, b, r = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    s_, h = b // heads, b % heads
    rep = s_ * reps + r  # the tangents' batch row: sequence s_, replica r
    rows = pid_m * BM + tl.arange(0, BM)
    dims = tl.arange(0, D)
    rmask = rows < t_q
    q = tl.load(Q + s_ * sq0 + h * sq1 + rows[:, None] * sq2 + dims[None, :], mask=rmask[:, None], other=0.0)
    qt = tl.load(QT + rep * sqt0 + h * sqt1 + rows[:, None] * sqt2 + dims[None, :], mask=rmask[:, None],
                 other=0.0)
    # the keys and key tangents centred over the keys for the scores' tangent (a row's constant leaves the
    # softmax's tangent as it is; a shared mean would enter each TF32 product at full size)
    kbar = tl.load(KBAR + b * D + dims)
    ktbar = tl.load(KTBAR + (rep * heads + h) * D + dims)
    m = tl.load(M + b * t_q + rows, mask=rmask, other=0.0)
    inv_l = 1.0 / tl.load(L + b * t_q + rows, mask=rmask, other=1.0)
    acc = tl.zeros((BM, D), tl.float32)
    acc_sum = tl.zeros((BM,), tl.float32)
    stream = seed + b * reps + r  # its own Philox stream
    hi = tl.minimum(t_k, off + (pid_m + 1) * BM)
    for start in range(0, hi, BN):
        cols = start + tl.arange(0, BN)
        kmask = cols[:, None] < t_k
        k = tl.load(K + s_ * sk0 + h * sk1 + cols[:, None] * sk2 + dims[None, :], mask=kmask, other=0.0)
        v = tl.load(V + s_ * sv0 + h * sv1 + cols[:, None] * sv2 + dims[None, :], mask=kmask, other=0.0)
        kt = tl.load(KT + rep * skt0 + h * skt1 + cols[:, None] * skt2 + dims[None, :], mask=kmask, other=0.0)
        vt = tl.load(VT + rep * svt0 + h * svt1 + cols[:, None] * svt2 + dims[None, :], mask=kmask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=SCORES) * scale
        valid = (cols[None, :] <= rows[:, None] + off) & (cols[None, :] < t_k)
        p = tl.where(valid, tl.exp(s - m[:, None]) * inv_l[:, None], 0.0)
        st = (tl.dot(qt, tl.trans(k - kbar[None, :])) + tl.dot(q, tl.trans(kt - ktbar[None, :]))) * scale
        info = tl.dot(tl.abs(q), tl.trans(tl.abs(k))) * scale  # |q| made per block: one tile fewer held
        a, c = u_bf16 * s, c_acc * info
        at = rows[:, None] * t_k + cols[None, :]
        # both stores' normals from one Philox call per element (Box-Muller's pair: independent)
        r0, r1, _, _ = tl.randint4x(stream, at)
        z1, z2 = tl.pair_uniform_to_normal(tl.uint_to_uniform_float(r0), tl.uint_to_uniform_float(r1))
        pt = p * (st + tl.sqrt(a * a + c * c) * z1)  # the scores' store, then p t
        acc_sum += tl.sum(pt, 1)
        w = pt + u_bf16 * p * z2  # the probabilities' store (|p| = p)
        acc += tl.dot(w, v) + tl.dot(p, vt)
    o = tl.load(O + b * t_q * D + rows[:, None] * D + dims[None, :], mask=rmask[:, None], other=0.0)
    ot = acc - acc_sum[:, None] * o  # p (t - sum p t) v: the softmax's tangent
    tl.store(OT + (rep * heads + h) * t_q * D + rows[:, None] * D + dims[None, :], ot, mask=rmask[:, None])
