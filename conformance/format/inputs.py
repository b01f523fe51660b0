"""Input families for the NVFP4 format checks: the canonical golden-snapshot weight, adversarial tensors for the
recipes (zeros, outliers, exact ties, subnormal and saturating scales), and scalar value families for the E2M1/E4M3
rounding oracles. Deterministic; every family is built from a fixed seed."""
from __future__ import annotations

import numpy as np
import torch

from conformance.format.oracles import E2M1_VALUES, E4M3_VALUES, FLT_MAX



# ----------------------------------------------------------------------------------------- input families
def canonical_weight(rows: int = 256, cols: int = 512, seed: int = 20260101) -> torch.Tensor:
    """The fixed-seed weight of the golden snapshots, bf16 ``[rows, cols]``. Generated with integer arithmetic only
    (splitmix64 -> four 24-bit uniforms -> Irwin-Hall sum, exact in float64) so it is identical on every platform and
    torch version. Row magnitudes step down by 2^-(row % 13) (small rows get E4M3-subnormal block scales) and every
    97th element is a x16 outlier."""
    n = rows * cols
    counters = np.arange(4 * n, dtype=np.uint64) + np.uint64(seed * 0x9E3779B97F4A7C15 % 2**64)
    z = counters
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    uniforms = (z >> np.uint64(40)).astype(np.float64) / float(1 << 24)  # top 24 bits in [0, 1)
    normalish = uniforms.reshape(n, 4).sum(axis=1) - 2.0
    row_scale = np.ldexp(1.0, -(np.arange(rows) % 13)).repeat(cols)
    outlier = np.where(np.arange(n) % 97 == 0, 16.0, 1.0)
    w = torch.from_numpy(normalish * row_scale * outlier).reshape(rows, cols)
    return w.to(torch.bfloat16)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _family_zeros() -> torch.Tensor:
    return torch.zeros(64, 64)


def _family_zero_blocks_mixed() -> torch.Tensor:
    x = torch.randn(64, 128, generator=_gen(1))
    x.view(64, 8, 16)[:, ::2] = 0.0
    return x


def _family_outlier_per_block() -> torch.Tensor:
    g = _gen(2)
    x = torch.randn(64, 256, generator=g) * 1e-3
    blocks = x.view(64, 16, 16)
    pos = torch.randint(0, 16, (64, 16, 1), generator=g)
    sign = torch.where(torch.rand(64, 16, 1, generator=g) < 0.5, -1.0, 1.0)
    blocks.scatter_(-1, pos, sign * 1e4)
    return x


def _family_code_ties() -> torch.Tensor:
    """Blocks ``2^j * [6, +-ties..., +-exact codes]``: with a power-of-two global scale the kernel recipe's scale is
    exactly 2^j / gs-factor, so every element lands exactly on an E2M1 value or midpoint."""
    g = _gen(3)
    pattern = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, -6.0])
    rows = []
    for j in range(-6, 7):
        for _ in range(4):
            perm = pattern[torch.randperm(16, generator=g)]
            rows.append(torch.cat([perm * 2.0**j for _ in range(8)]))
    return torch.stack(rows)


def _family_scale_ties() -> torch.Tensor:
    """Block amax = 6 * (midpoint between neighbouring E4M3 values): with gs = 1 the block scale is an exact E4M3 tie."""
    g = _gen(4)
    mids = [(E4M3_VALUES[b] + E4M3_VALUES[b + 1]) / 2 for b in range(0x00, 0x7E)]
    amax = torch.tensor(mids) * 6.0
    x = (torch.rand(len(mids), 16, generator=g) * 2 - 1) * amax.view(-1, 1) * 0.9
    x[:, 5] = amax * torch.where(torch.arange(len(mids)) % 2 == 0, 1.0, -1.0)
    return x  # [126, 16]: one block per row


def _family_subnormal_scales() -> torch.Tensor:
    """Block amax log-uniform in 6 * [2^-11, 2^-5]: with gs = 1 the block scales are E4M3 subnormals (or flush to 0)."""
    g = _gen(5)
    x = torch.rand(128, 8, 16, generator=g) * 2 - 1
    amax = 6.0 * torch.exp2(torch.rand(128, 8, 1, generator=g) * 6 - 11)
    x = x / x.abs().amax(-1, keepdim=True) * amax
    return x.reshape(128, 128)


def _family_saturating_scales() -> torch.Tensor:
    """Block amax up to 1e5: with gs = 1, gs * amax / 6 exceeds 448 and the scale saturates."""
    return torch.randn(64, 64, generator=_gen(6)) * 1e4


def _family_random() -> torch.Tensor:
    g = _gen(7)
    # 256 rows x 8 scale columns: two row tiles and two column tiles of the 128x4 swizzle
    return torch.randn(256, 128, generator=g) * torch.exp2(torch.randint(-20, 20, (256, 1), generator=g).float())


#: Tensor amax of :func:`_family_modelopt_scale_ties`: 1.75 = 7/4, so ``448 * b / amax`` hits E4M3 midpoints
#: for many bf16 block amaxes ``b``.
MODELOPT_TIE_AMAX = 1.75


def _family_modelopt_scale_ties() -> torch.Tensor:
    """ModelOpt's block scale ``b / (6 * ws2)`` with ``ws2 = amax / 2688`` lands exactly on an E4M3 midpoint:
    block amaxes ``b`` are the bf16 values with ``448 * b / amax`` a midpoint (exactly, in fp64); the fp32
    rounding of the two divisions then decides the tie, so the operation order shows (what a real checkpoint
    export hits at bf16 weights). Row 0 holds the tensor amax; one block per row, bf16-exact values."""
    amax = MODELOPT_TIE_AMAX
    mids = [(E4M3_VALUES[b] + E4M3_VALUES[b + 1]) / 2 for b in range(0x08, 0x7E)]  # normal range
    blocks = []
    for m in mids:
        b = m * amax / 448.0  # exact in fp64
        if float(torch.tensor(b, dtype=torch.float64).bfloat16()) == b:
            for sign in (1.0, -1.0):
                blocks.append([sign * b, -b / 3, b / 7, 0.0] + [b / 11] * 12)
    rows = torch.tensor(blocks, dtype=torch.float32)
    head = torch.zeros(1, 16)
    head[0, 0] = amax
    return torch.cat([head, rows]).bfloat16().float()


def _family_underflowing_scales() -> torch.Tensor:
    """One block at amax 1 (so ``ws2 = 1/2688``), the others with ideal E4M3 scales ``b / (6 ws2)`` from 2^-20
    to 2^-6: below 2^-10 plain rounding gives 0 and ModelOpt clamps to 2^-9; exactly 2^-10 is a tie; and
    all-zero blocks (ModelOpt: scale 1.0)."""
    g = _gen(8)
    ideal = torch.exp2(torch.linspace(-20.0, -6.0, 127))
    ideal[::9] = 2.0**-10  # exact ties between 0 and the smallest subnormal
    amax = ideal * 6.0 / 2688.0
    x = (torch.rand(127, 16, generator=g) * 2 - 1) * amax.view(-1, 1)
    x[:, 3] = amax
    x[::10] = 0.0
    head = torch.zeros(1, 16)
    head[0, :4] = torch.tensor([1.0, -0.5, 0.25, -0.0])
    return torch.cat([head, x])


ADVERSARIAL_FAMILIES = {
    "zeros": _family_zeros,
    "zero-blocks-mixed": _family_zero_blocks_mixed,
    "outlier-per-block": _family_outlier_per_block,
    "code-ties": _family_code_ties,
    "scale-ties": _family_scale_ties,
    "subnormal-scales": _family_subnormal_scales,
    "saturating-scales": _family_saturating_scales,
    "random-wide-range": _family_random,
    "modelopt-scale-ties": _family_modelopt_scale_ties,
    "underflowing-scales": _family_underflowing_scales,
}


def global_scales_for(x: torch.Tensor) -> list[float]:
    """Kernel-recipe global scales to try on ``x``: the canonical 448*6/amax (when amax > 0), 1, powers of two, and
    an arbitrary value."""
    amax = float(torch.nan_to_num(x.float().abs(), nan=0.0).amax())
    scales = [1.0, 32.0, 1234.567]
    if amax > 0:
        scales.insert(0, float(np.float32(448.0 * 6.0) / np.float32(amax)))
    return scales


# ----------------------------------------------------------------------------------------- scalar value families
def _around(values, ulps=(0, 1, 2)) -> np.ndarray:
    """``values`` and their float32 neighbours up to ``max(ulps)`` ulps away, both signs."""
    v = np.asarray(values, dtype=np.float32)
    out = [v]
    for u in ulps[1:]:
        up, down = v.copy(), v.copy()
        for _ in range(u):
            up = np.nextafter(up, np.float32(np.inf))
            down = np.nextafter(down, np.float32(-np.inf))
        out += [up, down]
    a = np.concatenate(out)
    return np.concatenate([a, -a])


_SPECIALS = np.array([0.0, np.inf, np.nan, FLT_MAX, 1e-45, 1e-40, 1.1754944e-38], dtype=np.float32)


def _e2m1_adversarial() -> dict[str, np.ndarray]:
    mags = np.array(E2M1_VALUES[:8], dtype=np.float32)
    mids = (mags[:-1] + mags[1:]) / 2
    return {
        "values-and-neighbours": _around(mags),
        "midpoints-and-neighbours": _around(mids),
        "saturation": _around([6.0, 6.5, 7.0, 8.0, 12.0, 1e10]),
        "specials": np.concatenate([_SPECIALS, -_SPECIALS]),
    }


def _e4m3_adversarial() -> dict[str, np.ndarray]:
    pos = np.array([E4M3_VALUES[b] for b in range(0x7F)], dtype=np.float64)
    mids = ((pos[:-1] + pos[1:]) / 2).astype(np.float32)
    return {
        "values-and-neighbours": _around(pos.astype(np.float32)),
        "midpoints-and-neighbours": _around(mids),
        "subnormal-boundaries": _around(np.ldexp(np.arange(0, 20, dtype=np.float32), -11)),
        "saturation": _around([448.0, 456.0, 464.0, 480.0, 512.0, 1e6, 3e38]),
        "specials": np.concatenate([_SPECIALS, -_SPECIALS]),
    }


E2M1_ADVERSARIAL = _e2m1_adversarial()
E4M3_ADVERSARIAL = _e4m3_adversarial()


def random_float32(n: int, seed: int, spread: tuple[int, int]) -> np.ndarray:
    """``n`` float32 values: half log-uniform magnitudes 2^spread[0] .. 2^spread[1] with random sign, a quarter
    uniform over the same span, a quarter random bit patterns (every class: subnormal, inf, NaN)."""
    rng = np.random.Generator(np.random.PCG64(seed))
    h, q = n // 2, n // 4
    lo, hi = spread
    log_uniform = np.exp2(rng.uniform(lo, hi, h)) * rng.choice([-1.0, 1.0], h)
    linear = rng.uniform(-(2.0**hi), 2.0**hi, q)
    bits = rng.integers(0, 2**32, n - h - q, dtype=np.uint64).astype(np.uint32).view(np.float32)
    return np.concatenate([log_uniform.astype(np.float32), linear.astype(np.float32), bits])


def real_model_like_weight(rows: int = 1024, cols: int = 2048, seed: int = 31) -> torch.Tensor:
    """A bf16 weight shaped like a trained LLM projection: heavy-tailed entries (Student-t, 4 degrees of freedom,
    std ~0.02), row norms spread log-normally (sigma 0.5) and 1% of input columns carrying x8 outlier channels."""
    g = _gen(seed)
    z = torch.randn(rows, cols, generator=g)
    chi2 = torch.randn(4, rows, cols, generator=g).square().sum(0)
    t = z / torch.sqrt(chi2 / 4.0)
    row_scale = torch.exp(0.5 * torch.randn(rows, 1, generator=g))
    col_scale = torch.where(torch.rand(1, cols, generator=g) < 0.01, 8.0, 1.0)
    return (0.02 / 1.41 * t * row_scale * col_scale).bfloat16()
