"""Red-team dense W4A16 backends, written from the adapter interface alone (not from tests/dense/mutants.py): the broken
ones (numeric and format slips real kernels make) the suite must reject; the correct-but-different ones it must
accept are in tests/dense/redteam_ok.py.

Every backend here decodes the checkpoint itself (its own E2M1 table and nibble order), so a bug in
reference_impl's decoder cannot make a mutant and the reference agree. Arithmetic is emulated exactly: the
products ``x_k * w_k`` are exact in fp32 (8 x 6 significant bits; 16 x 6 with an fp32 AWQ ``x'``), so an
"fp32 sum in order X" is a loop of fp32 additions over the ``[M, N, K]`` product tensor.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from conformance.interfaces.kernel import Backend, DenseLayer

_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
FP16_MAX = 65504.0


def decode_codes(packed: torch.Tensor, low_first: bool = True) -> torch.Tensor:
    """``[N, K/2]`` uint8 -> e2m1 values fp32 ``[N, K]``; element 2i in the low nibble unless ``low_first`` is False."""
    lo, hi = (packed & 0xF).long(), (packed >> 4).long()
    first, second = (lo, hi) if low_first else (hi, lo)
    codes = torch.stack((first, second), dim=-1).flatten(-2)
    mag = _E2M1.to(packed.device)[codes & 7]
    return torch.where(codes >= 8, -mag, mag)


def block_scales(scale: torch.Tensor) -> torch.Tensor:
    """``[N, K/16]`` e4m3 -> fp32, repeated to ``[N, K]``."""
    return scale.view(torch.float8_e4m3fn).float().repeat_interleave(16, dim=-1)


@dataclass
class Prepared:
    w: torch.Tensor  # fp32 [N, K], e2m1 * e4m3 (exact), alpha NOT applied
    alpha: float  # fp32 value
    bias: torch.Tensor | None  # fp32 [N]
    pqs: torch.Tensor | None  # fp32 [K]
    layer: DenseLayer


def products(x2: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``[M, N, K]`` fp32 products (exact: see the module docstring)."""
    return x2.float().unsqueeze(1) * w.unsqueeze(0)


def sequential_fp32(p: torch.Tensor, reverse: bool = False) -> torch.Tensor:
    acc = torch.zeros(p.shape[:-1], dtype=torch.float32)
    order = range(p.shape[-1] - 1, -1, -1) if reverse else range(p.shape[-1])
    for k in order:
        acc = acc + p[..., k]
    return acc


def pairwise_fp32(p: torch.Tensor) -> torch.Tensor:
    while p.shape[-1] > 1:
        if p.shape[-1] % 2:
            p = torch.cat((p, torch.zeros_like(p[..., :1])), dim=-1)
        p = p[..., 0::2] + p[..., 1::2]
    return p[..., 0]


def round_toward_zero_fp32(v: torch.Tensor) -> torch.Tensor:
    """fp64 -> fp32 rounding toward zero (a truncating adder's result)."""
    f = v.float()
    over = f.double().abs() > v.abs()
    return torch.where(over, torch.nextafter(f, torch.zeros_like(f)), f)


def truncate_to_bf16(v: torch.Tensor) -> torch.Tensor:
    bits = v.float().contiguous().view(torch.int32) & ~0xFFFF
    return bits.view(torch.float32).bfloat16()


def fp16_rn(v: torch.Tensor) -> torch.Tensor:
    return v.half().float()


def split_k(a: torch.Tensor, w: torch.Tensor, splits: int) -> list[torch.Tensor]:
    """The fp32 partial GEMMs of a split-K: K cut into ``splits`` slices of ``ceil(K / splits)`` (the last one
    shorter), one ``[M, N]`` partial each, in K order."""
    k = a.shape[-1]
    step = -(-k // splits)
    return [a[:, s : s + step] @ w[:, s : s + step].T for s in range(0, k, step)]


def awq_in_bf16(p: Prepared, x2: torch.Tensor) -> torch.Tensor:
    """The activations times ``pre_quant_scale`` rounded to BF16 (as SGLang does), as fp32."""
    return (x2 * p.pqs.bfloat16()).float() if p.pqs is not None else x2.float()


class DenseRedTeam(Backend):
    """A pure-PyTorch W4A16 dense layer with hooks; the base computes it correctly (fp32 matmul, fp32 epilogue,
    one rounding). Subclasses override one hook each."""

    name = "rt-dense-base"
    low_first = True

    def prepare_dense(self, layer: DenseLayer, device: torch.device) -> Any:
        w = decode_codes(layer.weight.cpu(), self.low_first) * self.scales(layer)
        alpha = float(self.alpha(layer))
        bias = None if layer.bias is None else layer.bias.float().cpu()
        pqs = None if layer.pre_quant_scale is None else layer.pre_quant_scale.float().cpu()
        return Prepared(w, alpha, bias, pqs, layer)

    def scales(self, layer: DenseLayer) -> torch.Tensor:
        return block_scales(layer.weight_scale.cpu())

    def alpha(self, layer: DenseLayer) -> torch.Tensor:
        return layer.weight_scale_2.float().max()

    def activations(self, p: Prepared, x2: torch.Tensor) -> torch.Tensor:
        """bf16 ``[M, K]`` -> the GEMM's left operand (fp32: exact AWQ product)."""
        xf = x2.float()
        return xf * p.pqs if p.pqs is not None else xf

    def accumulate(self, p: Prepared, a: torch.Tensor) -> torch.Tensor:
        return a @ p.w.T

    def epilogue(self, p: Prepared, acc: torch.Tensor) -> torch.Tensor:
        out = acc * torch.tensor(p.alpha, dtype=torch.float32)
        if p.bias is not None:
            out = out + p.bias
        return self.to_output(out)

    def to_output(self, out: torch.Tensor) -> torch.Tensor:
        return out.bfloat16()

    def run_dense(self, p: Prepared, x: torch.Tensor) -> torch.Tensor:
        lead, k = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, k).cpu()
        y = self.epilogue(p, self.accumulate(p, self.activations(p, x2)))
        return y.reshape(*lead, -1).to(x.device)


# ============================================================================ broken: FP16 activations
class Fp16WholeTensor(DenseRedTeam):
    """x converted to FP16 on entry (overflow to inf, subnormal loss, flush below 2^-24)."""
    name = "rt-fp16-whole"

    def activations(self, p, x2):
        return super().activations(p, x2.half().float().bfloat16())


class Fp16InsideGemm(DenseRedTeam):
    """AWQ scaling in BF16 as engines do, then an FP16 GEMM: x' and W in FP16, fp32 accumulation, FP16 output."""
    name = "rt-fp16-inside-gemm"

    def activations(self, p, x2):
        xs = (x2 * p.pqs.bfloat16()) if p.pqs is not None else x2
        return fp16_rn(xs.float())

    def to_output(self, out):
        return out.half().bfloat16()


class Fp16Clamped(DenseRedTeam):
    """Saturating FP16 conversion (cvt.sat): beyond +-65504 clamps instead of overflowing; no inf."""
    name = "rt-fp16-clamped"

    def activations(self, p, x2):
        return super().activations(p, x2.float().clamp(-FP16_MAX, FP16_MAX).half().float().bfloat16())


class Fp16FlushSubnormals(DenseRedTeam):
    """FP16 conversion with FTZ and saturation: |x| < 2^-14 -> 0, |x| > 65504 clamps."""
    name = "rt-fp16-ftz-sat"

    def activations(self, p, x2):
        xf = x2.float().clamp(-FP16_MAX, FP16_MAX)
        xf = torch.where(xf.abs() < 2.0**-14, torch.zeros_like(xf), xf)
        return super().activations(p, xf.half().float().bfloat16())


class Fp16OutputOnly(DenseRedTeam):
    """Correct fp32 GEMM, result stored in FP16 then converted to BF16 (output beyond 65504 -> inf)."""
    name = "rt-fp16-output"

    def to_output(self, out):
        return out.half().bfloat16()


class Fp16Accumulation(DenseRedTeam):
    """hgemm: FP16 operands and an FP16 accumulator (sequential)."""
    name = "rt-fp16-accumulation"

    def accumulate(self, p, a):
        prod = (fp16_rn(a).unsqueeze(1) * fp16_rn(p.w).unsqueeze(0)).half()
        acc = torch.zeros(prod.shape[:-1], dtype=torch.float16)
        for k in range(prod.shape[-1]):
            acc = acc + prod[..., k]
        return acc.float()


# ============================================================================ broken: one extra BF16 rounding
class Bf16SplitK(DenseRedTeam):
    """Split-K: each K slice summed in fp32, the partial stored in BF16, partials summed in fp32."""
    splits = 2
    name = "rt-bf16-splitk2"

    def accumulate(self, p, a):
        parts = [part.bfloat16().float() for part in split_k(a, p.w, self.splits)]
        return sum(parts[1:], parts[0])


class Bf16SplitK4(Bf16SplitK):
    splits = 4
    name = "rt-bf16-splitk4"


class Bf16SplitK8(Bf16SplitK):
    splits = 8
    name = "rt-bf16-splitk8"


class Bf16SplitKReducedInBf16(DenseRedTeam):
    """cuBLAS-style reduced-precision split-K: 4 partials, each alpha * partial stored in BF16, summed in BF16."""
    name = "rt-bf16-splitk4-bf16-reduction"

    def accumulate(self, p, a):
        acc = None
        for partial in split_k(a, p.w, 4):
            part = (partial * p.alpha).bfloat16()
            acc = part if acc is None else (acc.float() + part.float()).bfloat16()
        return acc.float()

    def epilogue(self, p, acc):
        return self.to_output(acc + p.bias if p.bias is not None else acc)


class TruncatingOutput(DenseRedTeam):
    """Final FP32 -> BF16 conversion drops the low bits."""
    name = "rt-truncating-output"

    def to_output(self, out):
        return truncate_to_bf16(out)


class RoundBeforeAlpha(DenseRedTeam):
    """GEMM writes BF16, alpha (and bias) applied afterwards in fp32 and rounded again."""
    name = "rt-round-before-alpha"

    def accumulate(self, p, a):
        return (a @ p.w.T).bfloat16().float()




# ============================================================================ broken: format slips
class NibbleOrderOddBlocks(DenseRedTeam):
    """High nibble first in every odd 16-element block (a tile-interleave slip)."""
    name = "rt-nibble-odd-blocks"

    def prepare_dense(self, layer, device):
        p = super().prepare_dense(layer, device)
        swapped = decode_codes(layer.weight.cpu(), low_first=False) * self.scales(layer)
        n, k = p.w.shape
        odd = (torch.arange(k) // 16) % 2 == 1
        p.w = torch.where(odd.view(1, k), swapped, p.w)
        return p


class LastBlockScaleFromPrevious(DenseRedTeam):
    """The last 16-block of each row reads the previous block's scale."""
    name = "rt-last-block-scale-prev"

    def scales(self, layer):
        s = layer.weight_scale.view(torch.float8_e4m3fn).float().cpu().clone()
        if s.shape[1] > 1:
            s[:, -1] = s[:, -2]
        return s.repeat_interleave(16, dim=-1)


class PartialScaleGroupZero(DenseRedTeam):
    """Scales come in groups of 4 (the 128x4 tile); a partial last group (K/16 % 4 != 0) reads padding: 0."""
    name = "rt-partial-scale-group-zero"

    def scales(self, layer):
        s = layer.weight_scale.view(torch.float8_e4m3fn).float().cpu().clone()
        full = s.shape[1] // 4 * 4
        s[:, full:] = 0
        return s.repeat_interleave(16, dim=-1)


class Ws2MinAcrossShards(DenseRedTeam):
    name = "rt-ws2-min"

    def alpha(self, layer):
        return layer.weight_scale_2.float().min()


class Ws2PerShard(DenseRedTeam):
    """Each fused shard dequantized with its own weight_scale_2 (not the engines' max)."""
    name = "rt-ws2-per-shard"

    def prepare_dense(self, layer, device):
        p = super().prepare_dense(layer, device)
        ws2 = layer.weight_scale_2.float().cpu()
        row_scale = torch.cat([ws2[i].expand(r) for i, r in enumerate(layer.shard_sizes)])
        p.w = p.w * (row_scale / p.alpha).view(-1, 1)
        return p


class ScalesAsUE4M3Fnuz(DenseRedTeam):
    """Block scales decoded as e4m3fnuz (exponent bias 8): every scale halved."""
    name = "rt-scales-fnuz"

    def scales(self, layer):
        return block_scales(layer.weight_scale.cpu()) * 0.5


class StridesIgnored(DenseRedTeam):
    """Reads x as if contiguous (the storage from its data pointer)."""
    name = "rt-strides-ignored"

    def run_dense(self, p, x):
        if not x.is_contiguous():
            x = torch.as_strided(x, x.shape, torch.empty(x.shape).stride(), x.storage_offset())
        return super().run_dense(p, x)


class AwqDivided(DenseRedTeam):
    name = "rt-awq-divided"

    def activations(self, p, x2):
        xf = x2.float()
        return xf / p.pqs if p.pqs is not None else xf


class FloorOutput(DenseRedTeam):
    """Final FP32 -> BF16 conversion rounds toward -inf: toward zero for positives, away from zero for negatives,
    so on signed data the toward-zero share stays ~1/2 (the direction statistic alone cannot see it)."""
    name = "rt-floor-output"

    def to_output(self, out):
        t = truncate_to_bf16(out).float()
        below = torch.nextafter(t.bfloat16(), torch.tensor(-float("inf"), dtype=torch.bfloat16)).float()
        down = torch.where(t > out, below, t)
        return down.bfloat16()


BROKEN = [
    Fp16WholeTensor, Fp16InsideGemm, Fp16Clamped, Fp16FlushSubnormals, Fp16OutputOnly, Fp16Accumulation,
    Bf16SplitK, Bf16SplitK4, Bf16SplitK8, Bf16SplitKReducedInBf16, TruncatingOutput, RoundBeforeAlpha,
    NibbleOrderOddBlocks, LastBlockScaleFromPrevious, PartialScaleGroupZero,
    Ws2MinAcrossShards, Ws2PerShard, ScalesAsUE4M3Fnuz, StridesIgnored, AwqDivided, FloorOutput,
]
